"""The launcher's parts without a mesh: the plan, the single-instance lock, process-group shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from services.launcher.children import ChildFailed, ChildProcess
from services.launcher.lock import AlreadyRunning, MeshLock
from services.launcher.mesh import SHARED_SERVICES_MIB, MeshConfig


def test_plan_uses_the_documented_ports_or_free_ones(tmp_path: Path) -> None:
    fixed = MeshConfig(data_dir=tmp_path, replicas=3)
    assert [fixed.inference_port(i) for i in range(3)] == [50052, 50062, 50072]
    assert fixed.milvus == str(tmp_path / "milvus.db")
    ephemeral = MeshConfig(data_dir=tmp_path, router_port=0, milvus_uri="http://milvus:19530")
    assert ephemeral.inference_port(1) == 0 and ephemeral.port(50054) == 0
    assert ephemeral.milvus == "http://milvus:19530"
    command = fixed.service_command("services.session", 50054, "--redis-url", "redis://x:1/0")
    assert command[1:] == [
        "-m", "services.session", "--host", "127.0.0.1", "--port", "50054", "--metrics-port", "0",
        "--redis-url", "redis://x:1/0",
    ]  # fmt: skip


def listen_host(command: list[str]) -> str:
    return command[command.index("--host") + 1]


def test_only_the_router_listens_on_host_everything_behind_it_on_loopback(tmp_path: Path) -> None:
    # `up --host 0.0.0.0` opens the router to the network; a retriever or session service there
    # would take any caller's word for its tenant (no API key is checked behind the router).
    config = MeshConfig(data_dir=tmp_path, host="0.0.0.0")
    behind = {
        "session": config.session_command(),
        "retriever": config.retriever_command(),
        "inference": config.replica_command(0, 1024),
    }
    assert {name: listen_host(c) for name, c in behind.items()} == dict.fromkeys(behind, "127.0.0.1")
    router = config.router_command(["127.0.0.1:50052"], "127.0.0.1:50054", "127.0.0.1:50053")
    assert listen_host(router) == "0.0.0.0"
    assert router[router.index("--retriever-addr") + 1] == "127.0.0.1:50053"
    # The router hashes prompt prefixes with the replicas' own tokenizer.
    assert router[router.index("--tokenizer") + 1] == str(config.model)


def test_the_router_serves_openai_http_on_8000_a_free_port_or_not_at_all(tmp_path: Path) -> None:
    args = (["127.0.0.1:50052"], "127.0.0.1:50054", "127.0.0.1:50053")

    def http_flags(config: MeshConfig) -> list[str]:
        command = config.router_command(*args)
        if "--no-http" in command:
            return ["--no-http"]
        return command[command.index("--http-port") : command.index("--http-port") + 2]

    assert http_flags(MeshConfig(data_dir=tmp_path)) == ["--http-port", "8000"]
    assert http_flags(MeshConfig(data_dir=tmp_path, router_port=0)) == ["--http-port", "0"]
    assert http_flags(MeshConfig(data_dir=tmp_path, http_port=None)) == ["--no-http"]


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [("replicas", 0, "--replicas"), ("router_port", 70000, "--port"), ("http_port", 70000, "--http-port")],
)
def test_plan_rejects_bad_flags_by_name(tmp_path: Path, field: str, value: int, flag: str) -> None:
    with pytest.raises(ValueError, match=f"^{flag} must be"):
        MeshConfig(data_dir=tmp_path, **{field: value})  # type: ignore[arg-type]


def test_second_lock_names_the_running_launcher_until_it_is_released(tmp_path: Path) -> None:
    first = MeshLock(tmp_path)
    first.acquire()
    first.record(router="127.0.0.1:50051")
    try:
        with pytest.raises(AlreadyRunning, match=rf"pid {os.getpid()}, router 127\.0\.0\.1:50051"):
            MeshLock(tmp_path).acquire()
    finally:
        first.release()
    again = MeshLock(tmp_path)
    again.acquire()
    again.release()


def test_terminate_reaches_everything_the_child_started(tmp_path: Path) -> None:
    # A shell that starts a grandchild and ignores SIGTERM itself: only the group SIGKILL ends it.
    script = "trap '' TERM; sleep 300 & echo started; wait"
    child = ChildProcess("stubborn", ["/bin/sh", "-c", script], tmp_path / "stubborn.log", dict(os.environ))
    child.start()
    deadline = time.monotonic() + 10
    while "started" not in child.tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.pid is not None
    family = [psutil.Process(child.pid), *psutil.Process(child.pid).children(recursive=True)]
    assert len(family) == 2
    child.terminate()
    child.wait_exit(timeout=1.0)
    _, alive = psutil.wait_procs(family, timeout=5)
    assert not alive
    assert "started" in (tmp_path / "stubborn.log").read_text()


def test_a_child_that_exits_early_fails_with_its_last_words(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    child = ChildProcess("inference-0", command, tmp_path / "inference-0.log", dict(os.environ)).start()
    with pytest.raises(ChildFailed, match=r"inference-0 exited \(code 3\)[\s\S]*no model here"):
        child.wait_serving(time.monotonic() + 10)


def test_replicas_share_the_memory_the_other_services_leave(tmp_path: Path) -> None:
    # Each replica would otherwise size its KV cache against the whole machine.
    plan = MeshConfig(data_dir=tmp_path, replicas=4, memory_limit_mib=10240)
    limit, share = plan.memory_plan()
    assert (limit.bytes >> 20, limit.source) == (10240, "--memory-limit-mib")
    assert share == (10240 - SHARED_SERVICES_MIB) // 4
    command = plan.replica_command(1, share)
    assert command[command.index("--memory-limit-mib") + 1] == str(share)
    assert command[command.index("--port") + 1] == "50062"
    # Without a flag the machine (or its cgroup) is what is shared.
    _, one = MeshConfig(data_dir=tmp_path).memory_plan()
    _, two = MeshConfig(data_dir=tmp_path, replicas=2).memory_plan()
    assert two == one // 2 and one + SHARED_SERVICES_MIB <= psutil.virtual_memory().total >> 20
    with pytest.raises(ValueError, match=r"^--memory-limit-mib must be >= 1"):
        MeshConfig(data_dir=tmp_path, memory_limit_mib=0)
    with pytest.raises(ValueError, match=r"^1500 MiB of memory \(--memory-limit-mib\) leaves nothing"):
        MeshConfig(data_dir=tmp_path, memory_limit_mib=1500).memory_plan()


def test_up_refuses_a_memory_limit_that_leaves_the_replicas_nothing(tmp_path: Path) -> None:
    # Refused before anything starts: no Redis, no lock file left behind.
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--port", "0", "--data-dir", str(tmp_path / "data"),
         "--memory-limit-mib", "1500"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "leaves nothing for 1 inference replica(s) after 2048 MiB" in done.stderr
    assert not (tmp_path / "data").exists()


def test_a_restarted_child_comes_back_on_the_port_it_had(tmp_path: Path) -> None:
    # Asked for --port 0 like every service under `up --port 0`; the restart must not move it.
    script = (
        "import socket, sys, time\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('127.0.0.1', int(sys.argv[sys.argv.index('--port') + 1]))); s.listen()\n"
        "print(f'llm-mesh fake listening on 127.0.0.1:{s.getsockname()[1]}', flush=True)\n"
        "time.sleep(300)\n"
    )
    command = [sys.executable, "-c", script, "--port", "0"]
    child = ChildProcess("fake", command, tmp_path / "fake.log", dict(os.environ)).start()
    try:
        child.wait_listening(time.monotonic() + 30)
        port, first_pid = child.port, child.pid
        assert port is not None and first_pid is not None
        child.wait_port("127.0.0.1", port, time.monotonic() + 30)
        os.kill(first_pid, signal.SIGKILL)
        assert child.proc is not None and child.proc.wait(10) == -signal.SIGKILL
        assert child.returncode == -signal.SIGKILL and not child.ready_now()
        child.kill_leftovers()
        child.restart()
        deadline = time.monotonic() + 30
        while not child.ready_now():
            assert time.monotonic() < deadline, child.tail()
            time.sleep(0.05)
        assert child.port == port and child.pid != first_pid and child.alive()
        assert child.command[-2:] == ["--port", str(port)]
        assert "--- llm-mesh up: restarting fake ---" in (tmp_path / "fake.log").read_text()
    finally:
        child.terminate()
        child.wait_exit(timeout=5.0)
