"""How the router dials the services behind it over TLS: replicas, session, retriever.

Each peer has its own ``--<peer>-tls-ca/-cert/-key`` flags: a CA alone dials with
TLS, a client certificate and key as well make it mutual TLS; no flag at all is
plaintext. Errors name the flag at fault, so a bad deployment fails at start.
"""

from __future__ import annotations

import re
import ssl
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
        tls = cls(
            root_certificates=_read_pem(f"--{peer}-tls-ca", ca),
            private_key=_read_pem(f"--{peer}-tls-key", key),
            certificate_chain=_read_pem(f"--{peer}-tls-cert", cert),
        )
        # Parsed now: a swapped certificate and key, or a CA file holding a key, were accepted and
        # then failed every call to the peer at the handshake (UNAVAILABLE).
        if ca is not None and tls.root_certificates is not None:
            _check_ca(f"--{peer}-tls-ca", ca, tls.root_certificates)
        if (
            cert is not None
            and key is not None
            and tls.certificate_chain is not None
            and tls.private_key is not None
        ):
            _check_pair(
                f"--{peer}-tls-cert", cert, tls.certificate_chain, f"--{peer}-tls-key", key, tls.private_key
            )
        return tls

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


_CERT_PEM = b"-----BEGIN CERTIFICATE-----"
_KEY_PEM = re.compile(rb"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----")


def _check_ca(flag: str, path: str, pem: bytes) -> None:
    if _CERT_PEM not in pem:
        raise ValueError(f"{flag} {path}: no PEM certificate in it{_is_key(pem)}")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: not a valid PEM CA certificate ({exc})") from None


def _check_pair(cert_flag: str, cert: str, cert_pem: bytes, key_flag: str, key: str, key_pem: bytes) -> None:
    if _CERT_PEM not in cert_pem:
        swapped = _KEY_PEM.search(cert_pem) and _CERT_PEM in key_pem
        hint = f" (it holds a private key: are {cert_flag} and {key_flag} swapped?)" if swapped else ""
        raise ValueError(f"{cert_flag} {cert}: no PEM certificate in it{hint or _is_key(cert_pem)}")
    if not _KEY_PEM.search(key_pem):
        certificate = " (it holds a certificate)" if _CERT_PEM in key_pem else ""
        raise ValueError(f"{key_flag} {key}: no PEM private key in it{certificate}")

    def no_password() -> bytes:
        raise ValueError(f"{key_flag} {key}: the private key is encrypted; gRPC takes an unencrypted key")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=no_password)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise ValueError(f"{key_flag} {key} is not the private key of {cert_flag} {cert}") from None
        raise ValueError(
            f"{cert_flag} {cert} / {key_flag} {key}: not a usable certificate and key ({exc})"
        ) from None


def _is_key(pem: bytes) -> str:
    return " (it holds a private key)" if _KEY_PEM.search(pem) else ""


def dial(address: str, tls: DialTls | None, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """A channel to ``address``: plaintext, or TLS with ``tls``."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)
