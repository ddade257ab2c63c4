"""Every flag takes its default from ``LLMMESH_<FLAG>``, so a container is configured by environment."""

from __future__ import annotations

import pytest

from services.common.settings import EnvArgumentParser
from tests.support.processes import ROOT


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


def test_a_required_flag_is_given_by_its_variable_as_the_deployments_give_the_replicas_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import yaml

    from services.common.settings import from_flags
    from services.inference.__main__ import build_parser
    from services.inference.config import EngineConfig

    documents = yaml.safe_load_all((ROOT / "deploy/k8s/base/inference.yaml").read_text())
    (manifest,) = [d for d in documents if d and d["kind"] == "Deployment"]
    (container,) = [c for c in manifest["spec"]["template"]["spec"]["containers"] if c["name"] == "inference"]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    assert "LLMMESH_MODEL" in env and "--model" not in container["args"]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = from_flags(EngineConfig, build_parser().parse_args(container["args"]))
    assert config.model == env["LLMMESH_MODEL"]
    # Without the variable the flag is still required: a replica never starts with no model.
    monkeypatch.delenv("LLMMESH_MODEL")
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


def test_help_is_not_a_setting(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LLMMESH_HELP", "1")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    assert "LLMMESH_HELP" not in capsys.readouterr().out
