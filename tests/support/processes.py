"""Run services as real processes on ephemeral ports, for integration and e2e tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

from services.launcher.process_output import ProcessHandle
from services.launcher.readiness import health_status, wait_serving

ROOT = Path(__file__).resolve().parents[2]
# A test run killed by a timeout never reaches its fixtures' teardown; children
# started through `setpriv --pdeathsig` get SIGTERM when the test process dies.
# (A preexec_fn would force fork() in a process that has gRPC threads, which
# gRPC's fork handlers do not survive.)
SETPRIV = shutil.which("setpriv")
DIE_WITH_PARENT = [SETPRIV, "--pdeathsig", "TERM"] if SETPRIV else []


class ServiceProcess(ProcessHandle):
    """One service started as ``python -m <module> --port 0 …``.

    The bootstrap prints ``llm-mesh <service> listening on HOST:PORT``; we read
    the port from there, so tests never race for a port.
    """

    # Started and not yet stopped: a failing test's report shows their last lines
    # (tests/conftest.py), since a client only sees the status a service sent, not its traceback.
    running: ClassVar[list[ServiceProcess]] = []

    def __init__(self, module: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.module = module
        self.args = args
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        super().__init__()  # keeps everything it prints

    @property
    def address(self) -> str:
        assert self.port is not None, "not started"
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0, wait_serving: bool = True) -> ServiceProcess:
        cmd = [*DIE_WITH_PARENT, sys.executable, "-m", self.module, *self.args]
        if "--port" not in self.args:
            cmd += ["--port", "0"]
        self.launch(cmd, self.module, cwd=ROOT, env=self.env)
        ServiceProcess.running.append(self)
        deadline = time.monotonic() + timeout
        if not self.wait_listening_line(deadline):
            raise RuntimeError(f"{self.module} did not start:\n" + self.output())
        if wait_serving:
            self.wait_serving(max(1.0, deadline - time.monotonic()))
        return self

    def output(self, last: int = 200) -> str:
        return self.out.tail(last)

    @classmethod
    def log_tails(cls, last: int = 40) -> str:
        """The last lines of every running service's output, each under its module and pid."""
        parts = []
        for service in cls.running:
            pid = service.proc.pid if service.proc is not None else "?"
            parts.append(f"--- {service.module} (pid {pid}), last {last} lines\n{service.output(last)}")
        return "\n".join(parts)

    def health(self, service: str = "", timeout: float = 2.0) -> int:
        return health_status(self.address, service, timeout)

    def wait_serving(self, timeout: float = 180.0) -> None:
        if not wait_serving(self.address, time.monotonic() + timeout, alive=self._alive):
            if not self._alive():
                raise RuntimeError(f"{self.module} exited:\n" + self.output())
            raise TimeoutError(f"{self.module} not SERVING after {timeout}s:\n" + self.output())

    def alive(self) -> bool:
        """Started and not yet exited."""
        return self.proc is not None and self.proc.poll() is None

    def _alive(self) -> bool:
        # Not started yet counts as alive: the wait then times out, as before, rather than saying "exited".
        return self.proc is None or self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self in ServiceProcess.running:
            ServiceProcess.running.remove(self)
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> ServiceProcess:
        # `with ServiceProcess(...).start(...)` must not start a second process.
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
