"""One child process of the launcher: its own process group, a log file, ports read from its output."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from pathlib import Path

from services.launcher.process_output import ProcessHandle, ProcessOutput
from services.launcher.readiness import is_serving, port_accepts, wait_port, wait_serving

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: if the launcher is SIGKILLed, the kernel sends us SIGTERM.

    Without it a killed launcher would leave the whole mesh running with nobody to stop it.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ChildFailed(RuntimeError):
    """A child exited or did not become ready in time."""


class ChildProcess(ProcessHandle):
    """A service (or Redis, or the gateway) started in a new session so that Ctrl-C reaches only the launcher.

    The launcher decides the shutdown order, and a signal to the group also
    reaches anything the child started itself (an engine worker, a tokenizer pool).
    """

    def __init__(self, name: str, command: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.command = command
        self.log_path = log_path
        self.env = env
        # What it printed (the last 40 lines) and the ports it announced; also copied to its log.
        super().__init__(ProcessOutput(keep=40, log_path=log_path))
        # How start-up decided it was ready, so a restart is judged the same way.
        self._ready_by_port = False

    @property
    def address(self) -> str:
        if self.port is None:
            raise ChildFailed(f"{self.name} has no known port yet")
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        """Its exit status once it has exited (negative: killed by that signal)."""
        return self.proc.poll() if self.proc else None

    def start(self) -> ChildProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.launch(
            self.command,
            self.name,
            env=self.env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # only prctl: safe between fork and exec
        )
        return self

    def restart(self) -> None:
        """Start the same command again on the port it had, so every client's address stays right.

        ``--port 0`` (tests) is replaced by the port the first run got.
        """
        if self.port is not None and "--port" in self.command:
            at = self.command.index("--port") + 1
            self.command = [*self.command[:at], str(self.port), *self.command[at + 1 :]]
        if self.http_port is not None and "--http-port" in self.command:
            at = self.command.index("--http-port") + 1  # the same for the router's HTTP clients
            self.command = [*self.command[:at], str(self.http_port), *self.command[at + 1 :]]
        self.out.restarting()
        # In the tail too: a give-up message shows where each run's last words begin.
        marker = f"--- llm-mesh up: restarting {self.name} ---"
        self.out.note(marker)
        with open(self.log_path, "ab") as log:
            log.write(f"{marker}\n".encode())
        self.start()

    def ready_now(self) -> bool:
        """One quick readiness check (the one start-up used): health SERVING, or the port open."""
        if self.port is None or not self.alive():
            return False
        if self._ready_by_port:
            return port_accepts(self.host, self.port)
        return self.out.listening.is_set() and is_serving(self.address, timeout=1.0)

    def kill_leftovers(self) -> None:
        """SIGKILL whatever is left in an exited child's process group (workers it forked)."""
        self._signal_group(signal.SIGKILL)

    def tail(self) -> str:
        """The last lines it printed, for an error message."""
        return self.out.tail(20)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _check_alive(self) -> None:
        if not self.alive():
            code = self.proc.returncode if self.proc else None
            raise ChildFailed(f"{self.name} exited (code {code}); see {self.log_path}:\n{self.tail()}")

    def wait_listening(self, deadline: float) -> None:
        """Until the bootstrap printed its `listening on` line (which names an ephemeral port)."""
        if not self.wait_listening_line(deadline):
            self._check_alive()
            raise ChildFailed(f"{self.name} did not start listening; see {self.log_path}")

    def wait_serving(self, deadline: float) -> None:
        """Until the gRPC health check answers SERVING (models loaded, stores connected)."""
        self.wait_listening(deadline)
        if not wait_serving(self.address, deadline, alive=self.alive, poll_s=0.25):
            self._check_alive()
            raise ChildFailed(f"{self.name} not SERVING in time; see {self.log_path}:\n{self.tail()}")

    def wait_port(self, host: str, port: int, deadline: float) -> None:
        """Until something accepts TCP connections on host:port (Redis, the gateway)."""
        if not wait_port(host, port, deadline, alive=self.alive):
            self._check_alive()
            raise ChildFailed(f"{self.name} not accepting connections on {host}:{port}")
        self.out.host, self.out.port = host, port
        self._ready_by_port = True

    def terminate(self) -> None:
        """SIGTERM to the whole group: the service drains (NOT_SERVING, finish in-flight, exit)."""
        self._signal_group(signal.SIGTERM)

    def wait_exit(self, timeout: float) -> None:
        """Wait for a terminated child; SIGKILL its group if it takes longer than ``timeout``."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.proc.wait(10)
        # Anything the child left behind in its group goes too.
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
