"""`llm-mesh up` as a subprocess: wait for its ready block, learn its endpoints, stop it, check nothing is left."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from services.launcher.process_output import ProcessOutput, start_process

ROOT = Path(__file__).resolve().parents[2]
READY_LINE = "llm-mesh is up"
ENDPOINT_RE = re.compile(r"^  (\S+)\s+(\d+\.\d+\.\d+\.\d+:\d+)(?:\s+metrics http://(\S+)/metrics)?$")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


class ReadyBlockOutput(ProcessOutput):
    """`up`'s output, kept whole, with the endpoints of its ready block read as they are printed.

    The block (after ``llm-mesh is up``, ending at the ``stop:`` hint) names the
    ephemeral ports, which the tests can learn from nowhere else.
    """

    def __init__(self) -> None:
        super().__init__()
        self.endpoints: dict[str, str] = {}
        self.metrics: dict[str, str] = {}
        self.ready = threading.Event()
        self.block_done = threading.Event()

    def note(self, line: str) -> None:
        super().note(line)
        if line == READY_LINE:
            self.ready.set()
        elif self.ready.is_set() and not self.block_done.is_set():
            if m := ENDPOINT_RE.match(line):
                self.endpoints[m.group(1)] = m.group(2)
                if m.group(3):
                    self.metrics[m.group(1)] = m.group(3)
            if line.startswith("stop:"):
                self.block_done.set()


class LaunchedMesh:
    """One `llm-mesh up --port 0` with its own data dir, Redis and Milvus Lite file."""

    def __init__(self, data_dir: Path, trace_file: Path, *flags: str) -> None:
        self.data_dir = data_dir
        self.trace_file = trace_file
        # More `up` flags (`--replicas 2`).
        self.flags = flags
        self.proc: subprocess.Popen[bytes] | None = None
        self.out = ReadyBlockOutput()

    @property
    def lines(self) -> list[str]:
        return self.out.lines

    @property
    def endpoints(self) -> dict[str, str]:
        return self.out.endpoints

    @property
    def metrics(self) -> dict[str, str]:
        return self.out.metrics

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "MILVUS_URI")}
        env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", LLMMESH_TRACE_FILE=str(self.trace_file))
        return env

    @property
    def router(self) -> str:
        return self.endpoints["router"]

    def start(self, timeout: float = 600.0) -> LaunchedMesh:
        self.proc, _ = start_process(
            cli("up", "--port", "0", "--data-dir", str(self.data_dir), "--stop-timeout", "30", *self.flags),
            self.out,
            "llm-mesh-up",
            cwd=ROOT,
            env=self.env,
        )
        deadline = time.monotonic() + timeout
        while not self.out.block_done.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = self.output()
                self.stop()
                raise RuntimeError(f"llm-mesh up did not become ready:\n{output}")
        return self

    def pids(self) -> dict[str, int]:
        """name -> pid of each running child, as the launcher keeps them in its lock file."""
        record = json.loads((self.data_dir / "llm-mesh.lock").read_text() or "{}")
        return {str(name): int(pid) for name, pid in record.get("pids", {}).items()}

    def output(self) -> str:
        return "\n".join(self.lines[-200:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def descendants(self) -> list[psutil.Process]:
        assert self.proc is not None
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def terminate(self, timeout: float = 120.0) -> int:
        """SIGTERM the launcher and wait for it; SIGKILL everything if it hangs (and fail loudly)."""
        assert self.proc is not None
        children = self.descendants()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_everything(children)
            raise

    def stop(self) -> None:
        """Cleanup for fixtures: never leaves a process behind, whatever state the mesh is in."""
        if self.proc is None:
            return
        children = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(120)
        self.kill_everything(children)

    def kill_everything(self, children: list[psutil.Process]) -> None:
        for process in [*children, *([psutil.Process(self.proc.pid)] if self.alive() else [])]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        if self.proc is not None:
            self.proc.wait(30)
