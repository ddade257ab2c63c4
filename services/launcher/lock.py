"""The one-mesh-per-data-dir lock, so a second `llm-mesh up` says so instead of failing on a taken port."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import IO, Any

from services.launcher.readiness import port_accepts


class AlreadyRunning(RuntimeError):
    """Another launcher holds the lock, or something already listens on a port we need."""


class MeshLock:
    """An exclusive ``flock`` on ``<data-dir>/llm-mesh.lock`` holding the running launcher's pid and router.

    flock, not just a pid file: the kernel drops it when the launcher dies, so a
    stale file never blocks the next start.
    """

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "llm-mesh.lock"
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the launcher's lifetime
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = _parse(f.read())
            f.close()
            pid = owner.get("pid", "?")
            router = owner.get("router", "?")
            raise AlreadyRunning(
                f"llm-mesh is already running (pid {pid}, router {router}, data {self.path.parent}); "
                f"stop it with Ctrl-C in its terminal or `kill -TERM {pid}`"
            ) from None
        self._file = f
        self.record(router="starting")

    def record(self, **fields: Any) -> None:
        """Rewrite the lock file's contents (who holds it, where the router listens)."""
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()
        json.dump({"pid": os.getpid(), **fields}, self._file)
        self._file.flush()

    def release(self) -> None:
        if self._file is None:
            return
        with contextlib.suppress(OSError):
            self._file.seek(0)
            self._file.truncate()
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None


def running_mesh(data_dir: Path) -> dict[str, Any] | None:
    """What the launcher running on ``data_dir`` recorded (pid, router, endpoints, …), or None
    when no launcher holds the lock there (a leftover file from a stopped mesh says nothing)."""
    path = data_dir / "llm-mesh.lock"
    if not path.exists():
        return None
    with open(path) as f:
        try:
            # A shared lock is refused exactly while a launcher holds its exclusive one.
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _parse(f.read())
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def _parse(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def port_in_use(host: str, port: int) -> bool:
    """True when something accepts connections on host:port (a mesh started from another data dir)."""
    if port == 0:
        return False
    return port_accepts(host, port)
