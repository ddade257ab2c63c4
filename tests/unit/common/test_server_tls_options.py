"""A service's own TLS flags: --tls-client-ca alone must not quietly serve plaintext."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common.server import server_channel_options, server_credentials
from services.common.settings import EnvArgumentParser, ServerOptions, add_server_args, server_options

ROOT = Path(__file__).resolve().parents[3]


def test_a_client_ca_without_a_server_certificate_is_refused() -> None:
    """It served plaintext and checked no client (every service: session, retriever, router…)."""
    parser = EnvArgumentParser()
    add_server_args(parser, default_port=0)
    args = parser.parse_args(["--tls-client-ca", "ca.pem"])
    with pytest.raises(ValueError, match="--tls-client-ca needs --tls-cert and --tls-key"):
        server_options("session", args)


def test_tls_flags_that_belong_together_are_accepted() -> None:
    assert server_credentials(ServerOptions(service="session")) is None  # plaintext, as asked
    options = ServerOptions(service="session", tls_cert="s.pem", tls_key="s.key", tls_client_ca="ca.pem")
    assert options.tls_client_ca == "ca.pem"
    assert ServerOptions(service="session", tls_client_ca="").tls_client_ca == ""  # empty env = unset


@pytest.mark.parametrize("service", ["session", "retriever", "inference", "router"])
def test_each_service_says_the_refusal_in_one_line_and_exits_2(service: str) -> None:
    """Each service's command line: a usage error naming the flags, not a traceback."""
    command = [sys.executable, "-m", f"services.{service}", "--tls-client-ca", "ca.pem"]
    if service == "router":
        command += ["--replicas", "127.0.0.1:1"]
    if service == "inference":
        command += ["--model", "no-such-model"]  # the flags are checked before the files
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "error: --tls-client-ca needs --tls-cert and --tls-key: without them the service would serve "
            "plaintext and check no client certificate"
        )
    ), done.stderr


def test_client_names_need_a_client_ca_and_are_read_as_a_set() -> None:
    with pytest.raises(ValueError, match="--tls-client-names needs --tls-client-ca"):
        ServerOptions(service="session", tls_client_names="router")
    options = ServerOptions(
        service="session", tls_cert="s.pem", tls_key="s.key", tls_client_ca="ca.pem",
        tls_client_names=" router, session ,",
    )  # fmt: skip
    assert options.client_names == {"router", "session"}


def test_a_connection_age_bound_reaches_grpc_core_and_none_is_the_default() -> None:
    default = dict(server_channel_options(ServerOptions(service="retriever")))
    assert "grpc.max_connection_age_ms" not in default
    aged = dict(server_channel_options(ServerOptions(service="retriever", max_connection_age_s=300)))
    assert aged["grpc.max_connection_age_ms"] == 300_000
    with pytest.raises(ValueError, match="--max-connection-age-s"):
        ServerOptions(service="retriever", max_connection_age_s=-1)
