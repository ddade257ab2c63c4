"""Every flag takes its default from ``LLMMESH_<FLAG>``, so a container is configured by environment."""

from __future__ import annotations

import pytest

from services.common.settings import EnvArgumentParser


def _parser() -> EnvArgumentParser:
    parser = EnvArgumentParser()
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--no-http", action="store_true")
    parser.add_argument("--http-cors-origin", action="append", default=[])
    return parser


def test_typed_switch_and_repeatable_flags_read_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMMESH_HTTP_PORT", "0")
    monkeypatch.setenv("LLMMESH_NO_HTTP", "true")
    # A repeatable flag's variable is a comma-separated list, not one value (nor its characters).
    monkeypatch.setenv("LLMMESH_HTTP_CORS_ORIGIN", "https://a.example, https://b.example:8443")
    args = _parser().parse_args([])
    assert (args.http_port, args.no_http) == (0, True)
    assert args.http_cors_origin == ["https://a.example", "https://b.example:8443"]


def test_without_variables_the_flags_keep_their_defaults_and_the_command_line_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("LLMMESH_HTTP_PORT", "LLMMESH_NO_HTTP", "LLMMESH_HTTP_CORS_ORIGIN"):
        monkeypatch.delenv(name, raising=False)
    args = _parser().parse_args(["--http-cors-origin", "*", "--http-port", "9"])
    assert (args.http_port, args.no_http, args.http_cors_origin) == (9, False, ["*"])
