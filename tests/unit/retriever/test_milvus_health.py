"""The Milvus health watcher: NOT_SERVING while Milvus cannot be reached, SERVING when it answers again.

A real HealthReporter over grpc's health servicer, and a check that the test controls in
place of ``MilvusCollections.ping``. The process-level behaviour (a Milvus server killed and
restarted under a running retriever) is in tests/integration/test_retriever_milvus_server.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import pytest
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer as AsyncHealthServicer
from pymilvus.client.types import LoadState

from services.common.errors import DependencyUnavailable
from services.common.server import HealthReporter
from services.retriever.connection import MilvusCollections
from services.retriever.milvus_health import MilvusHealthWatcher
from services.retriever.schema import CollectionNames

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NAMES = ("llmmesh.v1.Retriever",)


class Milvus:
    """What the check finds: up, down (DependencyUnavailable), or something unexpected."""

    def __init__(self) -> None:
        self.failure: BaseException | None = None
        self.checks = 0

    def check(self) -> None:
        self.checks += 1
        if self.failure is not None:
            raise self.failure


async def serving_health() -> tuple[AsyncHealthServicer, HealthReporter]:
    servicer = AsyncHealthServicer()
    reporter = HealthReporter(servicer, NAMES)
    await reporter.set_serving(True)  # what start-up reports once Milvus answered
    return servicer, reporter


async def status(servicer: AsyncHealthServicer, service: str = "") -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    response = await servicer.Check(request, None)  # type: ignore[arg-type]
    return int(response.status)


def run(test: Callable[[], object]) -> None:
    asyncio.run(test())  # type: ignore[arg-type]


def test_health_follows_milvus_with_one_log_line_per_change(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        servicer, reporter = await serving_health()
        milvus = Milvus()
        watcher = MilvusHealthWatcher(milvus.check, reporter, interval_s=60, timeout_s=1)
        await watcher.check_once()
        assert await status(servicer) == SERVING

        milvus.failure = DependencyUnavailable("Milvus at http://milvus:19530 is unreachable: refused")
        for _ in range(5):
            await watcher.check_once()
        assert await status(servicer) == NOT_SERVING
        assert await status(servicer, NAMES[0]) == NOT_SERVING

        milvus.failure = None
        for _ in range(3):
            await watcher.check_once()
        assert await status(servicer) == SERVING
        assert await status(servicer, NAMES[0]) == SERVING
        assert milvus.checks == 9
        await watcher.stop()

    with caplog.at_level(logging.INFO, logger="llmmesh.retriever"):
        run(scenario)
    assert [r.getMessage() for r in caplog.records] == [
        "Milvus at http://milvus:19530 is unreachable: refused; reporting NOT_SERVING until it answers",
        "Milvus answers again, reporting SERVING",
    ]


def test_an_unexpected_error_counts_as_unreachable_and_the_watcher_lives_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        servicer, reporter = await serving_health()
        milvus = Milvus()
        milvus.failure = RuntimeError("pymilvus surprised us")
        watcher = MilvusHealthWatcher(milvus.check, reporter, interval_s=0.01, timeout_s=1)
        watcher.start()
        while milvus.checks < 5:
            await asyncio.sleep(0.01)
        assert await status(servicer) == NOT_SERVING
        milvus.failure = None
        checks = milvus.checks
        while milvus.checks < checks + 2:
            await asyncio.sleep(0.01)
        assert await status(servicer) == SERVING  # the loop survived five unexpected errors
        await watcher.stop()

    with caplog.at_level(logging.INFO, logger="llmmesh.retriever"):
        run(scenario)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None  # logged once, with its traceback
    assert "pymilvus surprised us" in caplog.text


def test_a_check_that_hangs_counts_as_unreachable() -> None:
    async def scenario() -> None:
        servicer, reporter = await serving_health()
        release = threading.Event()
        watcher = MilvusHealthWatcher(
            lambda: release.wait(10) and None, reporter, interval_s=60, timeout_s=0.05
        )
        await watcher.check_once()  # bounded by 2 × timeout + 1 s
        assert await status(servicer) == NOT_SERVING
        release.set()
        await watcher.stop(wait_s=5)

    run(scenario)


def test_a_draining_server_is_never_reported_serving_again() -> None:
    async def scenario() -> None:
        servicer, reporter = await serving_health()
        milvus = Milvus()
        milvus.failure = DependencyUnavailable("Milvus at m is unreachable")
        watcher = MilvusHealthWatcher(milvus.check, reporter, interval_s=60, timeout_s=1)
        await watcher.check_once()
        await reporter.stop_serving()  # SIGTERM
        milvus.failure = None
        await watcher.check_once()  # Milvus is back, but the server is leaving
        assert await status(servicer) == NOT_SERVING
        await watcher.stop()

    run(scenario)


def test_stop_is_clean_while_a_check_runs_and_may_be_called_twice() -> None:
    async def scenario() -> None:
        _, reporter = await serving_health()
        started, release = threading.Event(), threading.Event()

        def slow_check() -> None:
            started.set()
            release.wait(10)

        watcher = MilvusHealthWatcher(slow_check, reporter, interval_s=0, timeout_s=10)
        watcher.start()
        while not started.is_set():
            await asyncio.sleep(0.01)
        await watcher.stop()  # drain: cancels the loop, does not wait for the thread
        asyncio.get_running_loop().call_later(0.2, release.set)
        await watcher.stop(wait_s=5)  # close: waits for the check before the client is closed
        assert release.is_set()

    run(scenario)


class _Client:
    """A MilvusClient whose collections are in the given load states."""

    def __init__(self, states: dict[str, LoadState]) -> None:
        self.states = states
        self.loads: list[str] = []

    def get_load_state(self, name: str, timeout: float | None = None) -> dict[str, LoadState]:
        return {"state": self.states[name]}

    def load_collection(self, name: str, timeout: float | None = None) -> None:
        self.loads.append(name)
        self.states[name] = LoadState.Loaded


def _collections(states: dict[str, LoadState]) -> tuple[MilvusCollections, _Client]:
    collections = MilvusCollections.__new__(MilvusCollections)  # no Milvus: only ping is exercised
    collections.names = NAMES_OF
    collections.shown_uri = "http://milvus:19530"
    collections._secrets = ()
    collections._timeout = 1.0
    client = _Client(states)
    collections._client = client
    return collections, client


NAMES_OF = CollectionNames.with_prefix("t")
ALL = (NAMES_OF.chunks, NAMES_OF.documents, NAMES_OF.cache)


def test_ping_loads_collections_that_milvus_came_back_without(caplog: pytest.LogCaptureFixture) -> None:
    """Milvus Lite's server forgets what was loaded when it restarts; every search then failed
    "call load() before search" while health said SERVING."""
    collections, client = _collections(
        {ALL[0]: LoadState.NotLoad, ALL[1]: LoadState.Loaded, ALL[2]: LoadState.NotLoad}
    )
    with caplog.at_level(logging.WARNING):
        collections.ping()
        collections.ping()
    assert client.loads == [ALL[0], ALL[2]]
    assert [r.getMessage() for r in caplog.records] == [
        f"loaded {ALL[0]}, {ALL[2]} again: Milvus had them unloaded (restarted?)"
    ]


@pytest.mark.parametrize("state", [LoadState.Loading, LoadState.NotExist])
def test_ping_fails_while_a_collection_cannot_be_searched(state: LoadState) -> None:
    collections, client = _collections({name: LoadState.Loaded for name in ALL} | {ALL[1]: state})
    with pytest.raises(DependencyUnavailable, match=f"collection {ALL[1]} is {state.name}"):
        collections.ping()
    assert client.loads == []
