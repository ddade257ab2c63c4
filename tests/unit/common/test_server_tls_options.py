"""A service's own TLS flags: --tls-client-ca alone must not quietly serve plaintext."""

from __future__ import annotations

import pytest

from services.common.server import server_credentials
from services.common.settings import EnvArgumentParser, ServerOptions, add_server_args, server_options


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
