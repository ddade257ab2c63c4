"""A service's own --tls-cert/--tls-key/--tls-client-ca are read and checked at start, as the router's
dial flags are: a swapped certificate and key, a key of another certificate or a file with no PEM in
it is a one-line usage error naming the flag (exit 2), not a traceback at the bind ("Failed to bind to
address") or a failure at the first handshake."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.settings import EnvArgumentParser, ServerOptions, add_server_args, server_options
from tests.support.certs import CertPaths, make_certs

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return make_certs(tmp_path_factory.mktemp("certs"))


def parse(argv: list[str]) -> ServerOptions:
    parser = EnvArgumentParser(prog="svc")
    add_server_args(parser, default_port=0)
    return server_options("session", parser.parse_args(argv), parser)


def test_good_server_tls_files_are_accepted(certs: CertPaths) -> None:
    argv = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    options = parse([*argv, "--tls-client-ca", str(certs.ca)])
    assert (options.tls_cert, options.tls_client_ca) == (str(certs.server_cert), str(certs.ca))
    assert parse([]).tls_cert is None  # plaintext: nothing to read


@pytest.mark.parametrize(
    ("which", "message"),
    [
        ("swapped", r"error: --tls-cert .*server\.key: no PEM certificate in it .*swapped\?"),
        ("key of another cert", r"error: --tls-key .*client\.key is not the private key of --tls-cert"),
        ("key is a cert", r"error: --tls-key .*ca\.pem: no PEM private key in it \(it holds a certificate\)"),
        ("cert not pem", r"error: --tls-cert .*notes\.txt: no PEM certificate in it$"),
        ("cert garbage pem", r"error: --tls-cert .*garbage\.pem / --tls-key .*: not a usable certificate"),
        ("client ca is a key", r"error: --tls-client-ca .*server\.key: no PEM certificate in it"),
        ("missing key", r"error: --tls-key .*nowhere\.key: cannot read: No such file"),
    ],
)
def test_bad_server_tls_files_are_a_usage_error_naming_the_flag(
    certs: CertPaths, tmp_path: Path, capsys: pytest.CaptureFixture[str], which: str, message: str
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a certificate\n")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    cert, key, ca = {
        "swapped": (certs.server_key, certs.server_cert, None),
        "key of another cert": (certs.server_cert, certs.client_key, None),
        "key is a cert": (certs.server_cert, certs.ca, None),
        "cert not pem": (notes, certs.server_key, None),
        "cert garbage pem": (garbage, certs.server_key, None),
        "client ca is a key": (certs.server_cert, certs.server_key, certs.server_key),
        "missing key": (certs.server_cert, tmp_path / "nowhere.key", None),
    }[which]
    argv = ["--tls-cert", str(cert), "--tls-key", str(key)]
    if ca is not None:
        argv += ["--tls-client-ca", str(ca)]
    with pytest.raises(SystemExit) as exited:
        parse(argv)
    assert exited.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("svc: error: "), line
    assert re.search(message, line), line


@pytest.mark.parametrize("service", ["router", "session", "retriever", "inference", "synthetic"])
def test_every_service_refuses_a_swapped_certificate_and_key_at_start(certs: CertPaths, service: str) -> None:
    """Run as deployed: one line naming the flag, exit 2, before anything is served or loaded."""
    command = [sys.executable, "-m", f"services.{service}", "--port", "0"]
    command += ["--tls-cert", str(certs.server_key), "--tls-key", str(certs.server_cert)]
    if service == "router":
        command += ["--replicas", "127.0.0.1:1", "--http-port", "0"]
    if service == "inference":
        command += ["--model", "no-such-model"]  # the flags are checked before the files
    if service == "session":
        command += ["--redis-url", "redis://127.0.0.1:1/0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "error: --tls-cert" in last and "swapped?" in last, done.stderr[-3000:]
