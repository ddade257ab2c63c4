"""PEM files named by TLS flags, read and checked at start so a bad deployment fails there, naming the flag.

Shared by the flags a service serves with (``--tls-cert/--tls-key/--tls-client-ca``, every service)
and the router's dial flags (``--<peer>-tls-ca/-cert/-key``): a swapped certificate and key, a key
of another certificate, or a file that holds no PEM was accepted and then failed at the first
handshake (dialling: UNAVAILABLE on every call) or at the bind (serving: "Failed to bind to address",
a traceback that names neither the flag nor the file).
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path

_CERT_PEM = b"-----BEGIN CERTIFICATE-----"
_KEY_PEM = re.compile(rb"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----")


def read_pem(flag: str, path: str | None) -> bytes | None:
    """The bytes of ``path`` (None when the flag is unset); ValueError naming ``flag`` when unreadable."""
    return None if path is None else _read(flag, path)


def _read(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from exc


def check_ca(flag: str, path: str, pem: bytes) -> None:
    """ValueError naming ``flag`` unless ``pem`` holds CA certificates OpenSSL can load."""
    if _CERT_PEM not in pem:
        raise ValueError(f"{flag} {path}: no PEM certificate in it{_is_key(pem)}")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: not a valid PEM CA certificate ({exc})") from None


def check_pair(cert_flag: str, cert: str, cert_pem: bytes, key_flag: str, key: str, key_pem: bytes) -> None:
    """ValueError naming the flag at fault unless ``cert`` and ``key`` are a PEM certificate and its
    own unencrypted private key (what gRPC and the HTTP front take)."""
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


def check_server_files(cert: str | None, key: str | None, client_ca: str | None) -> None:
    """A service's own ``--tls-cert/--tls-key/--tls-client-ca``, read and checked as the router's dial
    flags are; ValueError naming the flag at fault. Unset (None or empty) flags are not checked."""
    if cert and key:
        check_pair("--tls-cert", cert, _read("--tls-cert", cert), "--tls-key", key, _read("--tls-key", key))
    if client_ca:
        check_ca("--tls-client-ca", client_ca, _read("--tls-client-ca", client_ca))


def _is_key(pem: bytes) -> str:
    return " (it holds a private key)" if _KEY_PEM.search(pem) else ""
