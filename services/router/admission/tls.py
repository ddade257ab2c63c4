"""How the router dials the services behind it over TLS: replicas, session, retriever.

Each peer has its own ``--<peer>-tls-ca/-cert/-key`` flags: a CA alone dials with
TLS, a client certificate and key as well make it mutual TLS; no flag at all is
plaintext. Errors name the flag at fault, so a bad deployment fails at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


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
        return cls(
            root_certificates=_read_pem(f"--{peer}-tls-ca", ca),
            private_key=_read_pem(f"--{peer}-tls-key", key),
            certificate_chain=_read_pem(f"--{peer}-tls-cert", cert),
        )

    def credentials(self) -> grpc.ChannelCredentials:
        # No CA given: the peer's certificate is checked against the system roots.
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


def _read_pem(flag: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from exc


def dial(address: str, tls: DialTls | None, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """A channel to ``address``: plaintext, or TLS with ``tls``."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)
