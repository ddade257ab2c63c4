"""Start a child process and read what it prints: its lines, and the endpoints it announces.

The bootstrap (``services/common/server.py``) prints ``llm-mesh NAME listening on
HOST:PORT`` once its gRPC port is bound, then ``… metrics on …`` and, for the
router, ``… http on …``; the REST gateway and the relay-floor bench print the same
``listening on`` line. A child started on ``--port 0`` can only be found by reading
its port from there, so the launcher, the tests and the benches all start their
children through ``ProcessHandle`` and wait on ``wait_listening_line``.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LISTEN_RE = re.compile(r"llm-mesh (\S+) listening on (\S+):(\d+)")
HTTP_RE = re.compile(r"llm-mesh (\S+) http on (\S+):(\d+)")
METRICS_RE = re.compile(r"llm-mesh (\S+) metrics on (\S+):(\d+)")


class ProcessOutput:
    """A child's merged stdout and stderr, read line by line on a daemon thread.

    Keeps the lines (the last ``keep`` of them, or all), copies the raw output to
    ``log_path`` when given, and notes the announced host and ports.
    """

    def __init__(self, keep: int | None = None, log_path: Path | None = None) -> None:
        # A list, not a deque: tests scan it while the reader thread appends, which a deque refuses.
        self.lines: list[str] = []
        self.keep = keep
        self.log_path = log_path
        self.host: str | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        #: The router's OpenAI HTTP port, once it said so.
        self.http_port: int | None = None
        #: Set by the ``listening on`` line.
        self.listening = threading.Event()

    def follow(self, proc: subprocess.Popen[bytes], name: str = "child") -> None:
        """Read ``proc``'s stdout until it closes (the process exited), on a daemon thread."""
        threading.Thread(target=self._read, args=(proc,), name=f"output-{name}", daemon=True).start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        log = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115 - closed below
        try:
            for raw in proc.stdout:
                if log is not None:
                    log.write(raw)
                    log.flush()
                self.note(raw.decode(errors="replace").rstrip("\r\n"))
        finally:
            if log is not None:
                log.close()

    def note(self, line: str) -> None:
        """Keep one line (the reader's, or one of the caller's own, such as a restart marker)."""
        self.lines.append(line)
        if self.keep is not None and len(self.lines) > 2 * self.keep:
            del self.lines[: -self.keep]  # trimmed in bulk: a slice per line would cost O(keep) each
        if m := LISTEN_RE.search(line):
            self.host, self.port = m.group(2), int(m.group(3))
            self.listening.set()
        if m := METRICS_RE.search(line):
            self.metrics_port = int(m.group(3))
        if m := HTTP_RE.search(line):
            self.http_port = int(m.group(3))

    def restarting(self) -> None:
        """Before the same command starts again: wait for its new ``listening on`` and metrics lines.

        The port and the HTTP port stay (a restart is given the ones the first run got).
        """
        self.listening.clear()
        self.metrics_port = None

    def wait_listening(self, proc: subprocess.Popen[bytes], deadline: float, poll_s: float = 0.1) -> bool:
        """Until the ``listening on`` line came (True), or ``proc`` exited or ``deadline`` passed (False)."""
        while not self.listening.wait(poll_s):
            if proc.poll() is not None or time.monotonic() > deadline:
                return self.listening.is_set()
        return True

    def tail(self, last: int = 40) -> str:
        """The last lines, for an error message."""
        return "\n".join(self.lines[-last:])


def start_process(
    command: Sequence[str],
    output: ProcessOutput | None = None,
    name: str = "child",
    **popen: Any,
) -> tuple[subprocess.Popen[bytes], ProcessOutput]:
    """``command`` started with its stdout and stderr read into ``output`` (a new one by default).

    ``popen`` is passed to ``subprocess.Popen`` (``env``, ``cwd``, ``start_new_session`` …).
    """
    output = output if output is not None else ProcessOutput()
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)
    output.follow(proc, name)
    return proc, output


class ProcessHandle:
    """A child started by ``launch``: its ``proc``, its ``out``, and what it announced.

    The base of the launcher's, the tests' and the benches' process wrappers.
    """

    def __init__(self, out: ProcessOutput | None = None) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.out = out if out is not None else ProcessOutput()

    @property
    def host(self) -> str:
        return self.out.host or "127.0.0.1"

    @property
    def port(self) -> int | None:
        return self.out.port

    @property
    def metrics_port(self) -> int | None:
        return self.out.metrics_port

    @property
    def http_port(self) -> int | None:
        """The router's OpenAI HTTP port, once it said so."""
        return self.out.http_port

    @property
    def lines(self) -> list[str]:
        return self.out.lines

    def launch(self, command: Sequence[str], name: str, **popen: Any) -> subprocess.Popen[bytes]:
        self.proc, _ = start_process(command, self.out, name, **popen)
        return self.proc

    def wait_listening_line(self, deadline: float, poll_s: float = 0.1) -> bool:
        """Until the ``listening on`` line came (True), or the child exited or ``deadline`` passed."""
        assert self.proc is not None, "not started"
        return self.out.wait_listening(self.proc, deadline, poll_s)
