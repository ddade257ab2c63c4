"""`llm-mesh keys … --redis-url` when Redis cannot be had: one line naming the URL and a status a
script can tell apart (1: Redis unreachable; 2: a usage error such as a malformed URL), never a
traceback. Run as the command is run, in a subprocess, against a port nothing listens on."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]


def closed_port() -> int:
    """A port nothing listens on: bound, then released (connecting is refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def keys(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "keys", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "action",
    [["list"], ["add", "--tenant", "acme", "--id", "acme-web"], ["revoke", "--id", "acme-web"]],
    ids=lambda a: a[0],
)
def test_an_unreachable_redis_is_one_line_naming_the_url_and_exit_1(action: list[str]) -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"
    done = keys(*action, "--redis-url", url)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ") and url in lines[0] and "--redis-url" in lines[0], lines[0]
    assert done.stdout == ""  # `add` printed no key that was never stored


def test_the_url_is_named_without_its_password() -> None:
    url = f"redis://:hunter2@127.0.0.1:{closed_port()}/0"
    done = keys("list", "--redis-url", url)
    assert done.returncode == 1, done.stderr
    assert "hunter2" not in done.stderr and "127.0.0.1" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_malformed_redis_url_is_a_usage_error_naming_the_flag() -> None:
    done = keys("list", "--redis-url", "http://127.0.0.1:6379")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    line = done.stderr.strip()
    assert line.startswith("error: --redis-url") and "http://127.0.0.1:6379" in line, line


def test_an_unreachable_redis_cluster_is_one_line_too() -> None:
    url = f"redis://127.0.0.1:{closed_port()}"
    done = keys("list", "--redis-cluster", "--redis-url", url)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().startswith(f"error: cannot reach Redis at --redis-url {url}"), done.stderr
