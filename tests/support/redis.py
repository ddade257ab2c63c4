"""A real redis-server on a free port, which tests can kill and restart."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from services.launcher.readiness import free_port, redis_pong, wait_port
from services.launcher.redis_local import redis_command


class RedisServer:
    """redis-server with AOF `appendfsync always`, so acknowledged writes survive a restart."""

    def __init__(self, data_dir: Path, port: int | None = None, extra: list[str] | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = redis_command(self.data_dir, "127.0.0.1", self.port, fsync="always", extra=self.extra)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc = self.proc
        deadline = time.monotonic() + timeout
        if wait_port(
            "127.0.0.1", self.port, deadline, alive=lambda: proc.poll() is None, probe=redis_pong, poll_s=0.05
        ):
            return self
        raise TimeoutError(f"redis-server did not start on {self.port}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()
