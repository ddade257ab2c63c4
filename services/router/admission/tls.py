"""How the router dials the services behind it over TLS: replicas, session, retriever.

Each peer has its own ``--<peer>-tls-ca/-cert/-key`` flags: a CA alone dials with
TLS, a client certificate and key as well make it mutual TLS; no flag at all is
plaintext. Errors name the flag at fault, so a bad deployment fails at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

# The same checks as a service's own --tls-cert/--tls-key (services/common/settings.py).
from services.common.tls_files import check_ca, check_pair, read_pem


@dataclass(frozen=True)
class DialTls:
    """PEM material for dialling one kind of peer over TLS; with a certificate and key, mutual TLS."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None

    @classmethod
    def from_files(cls, peer: str, ca: str | None, cert: str | None, key: str | None) -> DialTls | None:
        """None when no flag is set (plaintext); raises ValueError naming ``--<peer>-tls-*`` at fault."""
        if ca is None and cert is None and key is None:
            return None
        if (cert is None) != (key is None):
            raise ValueError(f"--{peer}-tls-cert and --{peer}-tls-key go together")
        tls = cls(
            root_certificates=read_pem(f"--{peer}-tls-ca", ca),
            private_key=read_pem(f"--{peer}-tls-key", key),
            certificate_chain=read_pem(f"--{peer}-tls-cert", cert),
        )
        # Parsed now: a swapped certificate and key, or a CA file holding a key, were accepted and
        # then failed every call to the peer at the handshake (UNAVAILABLE).
        if ca is not None and tls.root_certificates is not None:
            check_ca(f"--{peer}-tls-ca", ca, tls.root_certificates)
        if (
            cert is not None
            and key is not None
            and tls.certificate_chain is not None
            and tls.private_key is not None
        ):
            check_pair(
                f"--{peer}-tls-cert", cert, tls.certificate_chain, f"--{peer}-tls-key", key, tls.private_key
            )
        return tls

    def credentials(self) -> grpc.ChannelCredentials:
        # No CA given: the peer's certificate is checked against the system roots.
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


def dial(address: str, tls: DialTls | None, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """A channel to ``address``: plaintext, or TLS with ``tls``."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)
