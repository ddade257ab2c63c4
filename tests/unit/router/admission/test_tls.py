"""The router's dial TLS flags are parsed at start: a bad certificate, key or CA is an error
naming the flag, not a router that starts and then fails every call to that peer (UNAVAILABLE)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.router import cli as router_cli
from services.router.admission.tls import DialTls
from tests.support.certs import CertPaths, make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_good_dial_flags_are_accepted(certs: CertPaths) -> None:
    tls = DialTls.from_files("session", str(certs.ca), str(certs.client_cert), str(certs.client_key))
    assert tls is not None and tls.certificate_chain == certs.client_cert.read_bytes()
    assert DialTls.from_files("retriever", str(certs.ca), None, None) is not None
    assert DialTls.from_files("replica", None, None, None) is None


@pytest.mark.parametrize(
    ("which", "message"),
    [
        ("swapped", r"--session-tls-cert .*client\.key: no PEM certificate .*swapped\?"),
        (
            "ca is a key",
            r"--session-tls-ca .*client\.key: no PEM certificate in it \(it holds a private key\)",
        ),
        (
            "key of another cert",
            r"--session-tls-key .*server\.key is not the private key of --session-tls-cert",
        ),
        (
            "key is a cert",
            r"--session-tls-key .*ca\.pem: no PEM private key in it \(it holds a certificate\)",
        ),
        ("garbage ca", r"--session-tls-ca .*garbage\.pem: not a valid PEM CA certificate"),
    ],
)
def test_bad_dial_flags_fail_at_start_naming_the_flag(
    certs: CertPaths, tmp_path: Path, which: str, message: str
) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    ca, cert, key = {
        "swapped": (certs.ca, certs.client_key, certs.client_cert),
        "ca is a key": (certs.client_key, certs.client_cert, certs.client_key),
        "key of another cert": (certs.ca, certs.client_cert, certs.server_key),
        "key is a cert": (certs.ca, certs.client_cert, certs.ca),
        "garbage ca": (garbage, None, None),
    }[which]
    with pytest.raises(ValueError, match=message):
        DialTls.from_files(
            "session", str(ca), None if cert is None else str(cert), None if key is None else str(key)
        )


def test_the_router_refuses_to_start_with_swapped_dial_flags(
    certs: CertPaths, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def serve(*args: object) -> None:
        raise AssertionError("the router started: every call to the session service would fail")

    monkeypatch.setattr(router_cli, "run", serve)
    argv = ["--replicas", "127.0.0.1:9", "--session-addr", "127.0.0.1:9"]
    argv += ["--session-tls-ca", str(certs.ca)]
    argv += ["--session-tls-cert", str(certs.client_key), "--session-tls-key", str(certs.client_cert)]
    with pytest.raises(SystemExit) as exited:
        router_cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error: --session-tls-cert" in err and "swapped?" in err
