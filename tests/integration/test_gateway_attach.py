"""`llm-mesh gateway` and `llm-mesh up --gateway` while a mesh runs: the REST sidecar attaches to that
mesh's router (found from its lock file), answers, and Ctrl-C stops it and nothing else.

The "running mesh" is a router over a synthetic replica plus the lock a launcher holds on its data
dir, recorded as `llm-mesh up` records it: what attaching reads, without loading a model."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.launcher import gateway
from services.launcher.lock import MeshLock
from tests.support.gateway import ensure_gateway_built
from tests.support.processes import ROOT, ServiceProcess

pytestmark = pytest.mark.timeout(900)  # a cold `make gateway` (apt, Go build) on a fresh clone

ADDRESS_RE = re.compile(r"gateway\s+http://(\S+)")


@dataclass
class RunningMesh:
    data_dir: Path
    router: ServiceProcess


@pytest.fixture(scope="module")
def running_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningMesh]:
    ensure_gateway_built()
    data_dir = tmp_path_factory.mktemp("attach-data")
    replica = ServiceProcess("services.synthetic", ["--log-level", "WARNING"]).start(timeout=120)
    router = ServiceProcess(
        "services.router",
        ["--replicas", replica.address, "--probe-interval-s", "0", "--log-level", "WARNING"],
    ).start(timeout=120)
    lock = MeshLock(data_dir)
    lock.acquire()
    lock.record(router=router.address, endpoints={"router": router.address})
    try:
        yield RunningMesh(data_dir, router)
    finally:
        lock.release()
        router.stop()
        replica.stop()


def attach(*argv: str) -> tuple[subprocess.Popen[str], str, list[str]]:
    """Start the command; returns it, the gateway's address from its ready block, and the lines so far."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *argv],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if m := ADDRESS_RE.search(line):
            return proc, m.group(1), lines
    proc.kill()
    raise AssertionError("no gateway address:\n" + "\n".join(lines))


def stop_with_ctrl_c(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=30)
    return proc.returncode, rest


def complete_over_rest(address: str) -> dict[str, object]:
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "sampling": {"max_tokens": 4, "ignore_eos": True},
    }
    response = httpx.post(f"http://{address}/v1/complete", json=body, timeout=30)
    assert response.status_code == 200, response.text
    answer: dict[str, object] = response.json()
    return answer


def router_still_serves(mesh: RunningMesh) -> bool:
    return mesh.router.health() == 1 and mesh.router.proc is not None and mesh.router.proc.poll() is None


def test_llm_mesh_gateway_attaches_to_the_running_router_and_ctrl_c_stops_only_the_gateway(
    running_mesh: RunningMesh,
) -> None:
    proc, address, lines = attach(
        "gateway", "--data-dir", str(running_mesh.data_dir), "--listen", "127.0.0.1:0"
    )
    try:
        assert "llm-mesh gateway is up" in lines
        assert f"→ router {running_mesh.router.address}" in lines[-1]
        assert httpx.get(f"http://{address}/healthz", timeout=10).status_code == 200
        answer = complete_over_rest(address)
        assert answer["end"]["usage"]["completion_tokens"] == 4  # type: ignore[index]
    finally:
        code, rest = stop_with_ctrl_c(proc)
    assert code == 0 and "llm-mesh gateway stopped" in rest
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{address}/healthz", timeout=5)
    assert router_still_serves(running_mesh)


def test_up_gateway_on_a_running_mesh_attaches_instead_of_refusing(running_mesh: RunningMesh) -> None:
    # --port 0: an ephemeral mesh, so the gateway takes a free port rather than 8080.
    proc, address, lines = attach("up", "--gateway", "--port", "0", "--data-dir", str(running_mesh.data_dir))
    try:
        assert any("already running" in line and "attaching the gateway" in line for line in lines)
        assert complete_over_rest(address)["text"]
    finally:
        code, _ = stop_with_ctrl_c(proc)
    assert code == 0
    assert router_still_serves(running_mesh)


def test_without_a_running_mesh_the_command_says_to_start_one(tmp_path: Path) -> None:
    nothing = subprocess.run(
        [sys.executable, "-m", "services.cli", "gateway", "--data-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert nothing.returncode == 1
    assert "no llm-mesh is running" in nothing.stderr and "llm-mesh up" in nothing.stderr


def test_an_unbuilt_gateway_is_named_with_the_command_that_builds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gateway, "GATEWAY_BINARY", tmp_path / "bin" / "llm-mesh-gateway")
    assert gateway.attach("127.0.0.1:1", "127.0.0.1:0", tmp_path) == 1
    assert "run `make gateway` first" in capsys.readouterr().err
