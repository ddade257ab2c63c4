"""Fixtures shared by every test package: the model directory, Redis, one shared real replica."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from xdist.remote import Producer

from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer
from tests.support.scheduling import LoadFileSharingMesh
from tests.support.shared_replica import load, shared_replica_process, wait_idle

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every router a test starts opens its OpenAI HTTP front on a free port, never the shared 8000.
os.environ.setdefault("LLMMESH_HTTP_PORT", "0")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadFileSharingMesh | None:
    """Under ``--dist loadfile`` (`make test`), the e2e files share a worker and its one `llm-mesh up`."""
    if config.getoption("dist", None) != "loadfile":
        return None
    return LoadFileSharingMesh(config, log)


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


@pytest.fixture(scope="session")
def _shared_replicas() -> Iterator[list[ServiceProcess]]:
    """The session's shared replica, started by the first file that asks for it (see below)."""
    started: list[ServiceProcess] = []
    yield started
    for replica in started:
        replica.stop()


@pytest.fixture(scope="module")
def shared_replica(_shared_replicas: list[ServiceProcess], model_path: Path) -> Iterator[ServiceProcess]:
    """A real replica with default flags (``tests/support/shared_replica.py``), one per test process.

    Idle when a file gets it, and checked idle again when the file is done: a file that left a
    stream running fails its own teardown instead of skewing the next file's counts. A replica
    that died or is draining (a test stopped it) is replaced, so the next file starts on a live one.
    """
    if not _shared_replicas or not _shared_replicas[-1].alive() or load(_shared_replicas[-1]).draining:
        _shared_replicas.append(shared_replica_process(model_path).start(timeout=240))
    replica = _shared_replicas[-1]
    wait_idle(replica)
    yield replica
    if replica.alive():
        wait_idle(replica)
