"""A program run in a pseudo-terminal, as a person at a keyboard would run it."""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import signal
import time


class PseudoTerminal:
    """Runs argv as the session leader of a new pty, so Ctrl-C (\\x03) becomes SIGINT as in a real terminal."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: becomes the program
            os.chdir(cwd)
            os.execvpe(argv[0], argv, env)
        self.pid = pid
        self.fd = fd
        self.transcript = ""
        self.exit_status: int | None = None

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def read_available(self, wait: float) -> str:
        ready, _, _ = select.select([self.fd], [], [], wait)
        if not ready:
            return ""
        try:
            data = os.read(self.fd, 4096).decode(errors="replace")
        except OSError:  # the child closed the terminal
            return ""
        self.transcript += data
        return data

    def expect(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        """Wait until ``pattern`` appears in the output after position ``start``."""
        deadline = time.monotonic() + timeout
        compiled = re.compile(pattern)
        while True:
            if m := compiled.search(self.transcript, start):
                return m
            if time.monotonic() > deadline or (not self.read_available(0.2) and not self.running()):
                if m := compiled.search(self.transcript, start):
                    return m
                raise TimeoutError(f"{pattern!r} not seen; transcript:\n{self.transcript[-3000:]}")

    def running(self) -> bool:
        if self.exit_status is not None:
            return False
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return True
        self.exit_status = os.waitstatus_to_exitcode(status)
        return False

    def wait_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.running():
            if time.monotonic() > deadline:
                raise TimeoutError("program did not exit")
            self.read_available(0.1)
        assert self.exit_status is not None
        return self.exit_status

    def close(self) -> None:
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self.fd)
