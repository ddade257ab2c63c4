"""API keys through `llm-mesh up` and `llm-mesh keys`: the key made is the key the router takes,
and the ready block's examples carry one when keys are on."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services import cli
from services.launcher.mesh import MeshConfig
from services.launcher.up import ready_block
from services.router.admission import keys
from services.router.admission.auth import Authenticator

ROUTER_ARGS = (["127.0.0.1:50052"], "127.0.0.1:50054", "127.0.0.1:50053")


@dataclass
class FakeRouterChild:
    host: str = "127.0.0.1"
    http_port: int | None = 8000


@dataclass
class FakeMesh:
    """What ``ready_block`` reads of a started mesh."""

    router: FakeRouterChild = field(default_factory=FakeRouterChild)
    redis: object = None
    redis_url: str = "redis://127.0.0.1:6379/0"

    def endpoints(self) -> dict[str, str]:
        return {"session": "127.0.0.1:50054", "router": "127.0.0.1:50051"}

    def metrics_endpoints(self) -> dict[str, str]:
        return {"router": "127.0.0.1:9100"}


def test_keys_add_writes_data_keys_yaml_by_default_and_the_router_accepts_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    default = tmp_path / "data" / "keys.yaml"
    monkeypatch.setattr(keys, "DEFAULT_KEYS_FILE", default)
    assert cli.main(["keys", "add", "--tenant", "acme", "--id", "acme-web"]) == 0
    key = capsys.readouterr().out.strip()
    assert default.is_file() and key not in default.read_text()  # only its hash is kept
    auth = Authenticator.from_file(default)
    assert auth.authenticate([("authorization", f"Bearer {key}")]).tenant == "acme"
    assert cli.main(["keys", "list"]) == 0
    assert '"acme-web"' in capsys.readouterr().out
    assert cli.main(["keys", "revoke", "--id", "acme-web"]) == 0
    with pytest.raises(Exception, match="revoked"):
        Authenticator.from_file(default).authenticate([("authorization", f"Bearer {key}")])


def test_up_passes_its_keys_file_to_the_router_and_refuses_a_missing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "keys.yaml"
    file.write_text("keys: []\n")
    command = MeshConfig(data_dir=tmp_path, api_keys_file=file).router_command(*ROUTER_ARGS)
    assert command[command.index("--api-keys-file") + 1] == str(file)
    assert "--api-keys-file" not in MeshConfig(data_dir=tmp_path).router_command(*ROUTER_ARGS)
    missing = tmp_path / "nope.yaml"
    assert cli.main(["up", "--port", "0", "--data-dir", str(tmp_path), "--api-keys-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "llm-mesh keys add" in err


def test_the_ready_block_shows_keyed_examples_only_when_keys_are_on(tmp_path: Path) -> None:
    file = tmp_path / "keys.yaml"
    file.write_text("keys: []\n")
    open_block = ready_block(FakeMesh(), MeshConfig(data_dir=tmp_path))  # type: ignore[arg-type]
    keyed_block = ready_block(FakeMesh(), MeshConfig(data_dir=tmp_path, api_keys_file=file))  # type: ignore[arg-type]
    assert "authorization" not in open_block and "api keys" not in open_block
    examples = [line for line in keyed_block.splitlines() if re.match(r"\s+(grpcurl|curl) ", line)]
    assert len(examples) == 2
    for line in examples:
        # As the shell would split it: one header argument, the key taken from the environment.
        assert "authorization: Bearer $LLMMESH_API_KEY" in shlex.split(line)
    assert f"llm-mesh keys add --file {file} --tenant NAME" in keyed_block


def test_a_redis_password_is_never_printed_nor_on_a_command_line(tmp_path: Path) -> None:
    # REDIS_URL with a password was printed in the ready block and given to the session service
    # and the router as --redis-url, where `ps` showed it to every local user.
    url = "redis://:S3cretPassw0rd@10.0.0.5:6379/0"
    block = ready_block(FakeMesh(redis_url=url), MeshConfig(data_dir=tmp_path))  # type: ignore[arg-type]
    assert "S3cretPassw0rd" not in block and "redis://:***@10.0.0.5:6379/0" in block
    config = MeshConfig(data_dir=tmp_path)
    for command in (config.session_command(), config.router_command(*ROUTER_ARGS)):
        assert "--redis-url" not in command and not any("S3cret" in part for part in command)
    # The URL reaches them by environment, which --redis-url defaults to (LLMMESH_REDIS_URL).
    assert config.redis_env(url) == {"LLMMESH_REDIS_URL": url}
    # The same for a Milvus server's URI (MILVUS_URI), which pymilvus takes credentials from.
    milvus = "http://root:MilvusPW123@milvus.internal:19530"
    server = MeshConfig(data_dir=tmp_path, milvus_uri=milvus)
    assert "MilvusPW123" not in ready_block(FakeMesh(), server)  # type: ignore[arg-type]
    assert "--milvus-uri" not in server.retriever_command()
    assert server.milvus_env() == {"LLMMESH_MILVUS_URI": milvus}


def test_up_takes_a_gguf_model_and_refuses_a_missing_one_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.launcher.up import check_model

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    check_model(gguf)  # README: `--model` accepts the safetensors directory or the GGUF
    missing = tmp_path / "not-mounted"
    with pytest.raises(ValueError, match="neither a model directory"):
        check_model(missing)
    # Through the command: exit 2 and one line naming the flag, not a traceback; nothing started.
    code = cli.main(["up", "--model", str(missing), "--data-dir", str(tmp_path / "data")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"llm-mesh up: --model {missing}:") and "Traceback" not in err
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())


def test_up_says_which_port_behind_the_router_is_taken_and_port_0_needs_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.launcher import up

    taken = {50054}  # another mesh's session service (its router on another port)
    monkeypatch.setattr(up, "port_in_use", lambda host, port: port in taken)
    started: list[MeshConfig] = []
    monkeypatch.setattr(up, "_run_mesh", lambda config, lock: started.append(config) or 0)
    monkeypatch.setattr(up, "ensure_model", lambda model: None)
    data = ["--data-dir", str(tmp_path / "second")]
    assert cli.main(["up", *data, "--port", "50061"]) == 1
    err = capsys.readouterr().err
    assert "127.0.0.1:50054 (the session service's port" in err and "--port 0" in err
    assert not started
    # --port 0: every service, the HTTP front included, on a free port; nothing taken matters.
    taken |= {50051, 50052, 50053, 8000}
    assert cli.main(["up", *data, "--port", "0"]) == 0
    assert len(started) == 1 and started[0].ephemeral
