"""Fixtures shared by every test package: the model directory, Redis."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every router a test starts opens its OpenAI HTTP front on a free port, never the shared 8000.
os.environ.setdefault("LLMMESH_HTTP_PORT", "0")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failing test's report ends with the services' own logs: the traceback behind an
    UNAVAILABLE is in the replica's output, not in anything the client received."""
    report = yield
    if report.failed and (tails := ServiceProcess.log_tails()):
        report.sections.append(("llm-mesh services (still running)", tails))
    return report


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model directory that `make setup` fetched."""
    path = Path(os.environ.get("LLMMESH_TEST_MODEL", ROOT / "models" / "SmolLM2-135M-Instruct"))
    if not (path / "config.json").exists():
        pytest.fail(f"model missing at {path}: run `make setup`")
    return path


@pytest.fixture()
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server per test, AOF on, that the test may kill and restart."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()
