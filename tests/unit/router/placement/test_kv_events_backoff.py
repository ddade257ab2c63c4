"""How often the KV-events consumer subscribes again: a draining replica (a snapshot, then the
stream ends) is backed off exponentially up to the cap, the backoff starts over only after a
subscription that stayed up, repeated gaps back off too; events past the replica's capacity drop
its entry with a warning. The waits are recorded, not slept (the module's ``asyncio.sleep`` is
replaced), except against a real in-process gRPC server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from services.gen.llmmesh.v1 import inference_pb2, inference_pb2_grpc
from services.inference.kv_events import KvEventLog
from services.inference.kv_watch import watch_kv_events
from services.router import metrics
from services.router.placement import kv_events
from services.router.placement.kv_events import Backoff, KvEventsConsumer
from services.router.placement.pool import ReplicaPool
from services.router.placement.prefix_index import PrefixIndex
from tests.unit.router.placement.test_kv_events_consumer import (
    ADDRESS,
    END,
    FakeIndex,
    FakeStub,
    NoStreams,
    Script,
    delta,
    snapshot,
    until,
)

real_sleep = asyncio.sleep


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RecordedSleep:
    """``asyncio`` as the consumer's module sees it, with ``sleep`` recorded (and the fake clock
    moved on by it) instead of slept."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.delays: list[float] = []
        self.clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def sleep(self, delay: float) -> None:
        self.delays.append(delay)
        if self.clock is not None:
            self.clock.now += delay
        await real_sleep(0)


@pytest.fixture()
def slept(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordedSleep]:
    recorder = RecordedSleep()
    monkeypatch.setattr(kv_events, "asyncio", recorder)
    yield recorder


def drained() -> Script:
    """What a draining replica answers a subscription with: its snapshot, then the end."""
    return [snapshot("i1", 7, [1, 2]), END]


async def follow(
    scripts: list[Script], index: Any = None, stub_type: type[FakeStub] = FakeStub, **consumer: Any
) -> tuple[ReplicaPool, FakeStub, KvEventsConsumer]:
    pool = ReplicaPool(NoStreams)
    pool.set_addresses([ADDRESS])
    stub = stub_type(scripts)
    pool.replicas[ADDRESS].stub = stub  # type: ignore[assignment]
    watcher = KvEventsConsumer(pool, index if index is not None else FakeIndex(), **consumer)
    watcher.start()
    return pool, stub, watcher


async def test_a_draining_replica_is_backed_off_exponentially_up_to_the_cap(slept: RecordedSleep) -> None:
    """Each subscription got a snapshot, which reset the backoff: a draining replica was asked
    again every 0.25 s for its whole drain (and sent its whole snapshot each time)."""
    backoff = Backoff(first_s=0.25, max_s=5.0, jitter=0.2)
    pool, stub, watcher = await follow([drained() for _ in range(8)], backoff=backoff)
    try:
        await until(lambda: len(slept.delays) == 8)
        expected = [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
        for delay, base in zip(slept.delays, expected, strict=True):
            assert base * 0.8 <= delay <= base * 1.2  # ±20 % jitter
        assert len(stub.calls) == 9  # the ninth stays open (the replica is back)
    finally:
        await watcher.stop()
        await pool.close()


async def test_the_backoff_starts_over_after_a_subscription_that_stayed_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()
    slept = RecordedSleep(clock)
    monkeypatch.setattr(kv_events, "asyncio", slept)

    class LastsAWhile(FakeStub):
        """The fifth subscription stays up 30 s (by the fake clock) before its stream ends."""

        def WatchKvEvents(self, request: inference_pb2.WatchKvEventsRequest) -> Any:
            if len(self.calls) == 4:
                clock.now += 30.0
            return super().WatchKvEvents(request)

    pool, _, watcher = await follow(
        [drained() for _ in range(7)],
        stub_type=LastsAWhile,
        backoff=Backoff(first_s=1.0, max_s=8.0, jitter=0.0, stable_s=5.0),
        clock=clock,
    )
    try:
        await until(lambda: len(slept.delays) == 7)
        # Four short ones climb; the long one resets; the next short ones climb again.
        assert slept.delays == [1.0, 2.0, 4.0, 8.0, 1.0, 2.0, 4.0]
    finally:
        await watcher.stop()
        await pool.close()


async def test_gaps_that_keep_coming_back_off_after_the_first_resync(slept: RecordedSleep) -> None:
    gaps: list[Script] = [[snapshot("i1", 0, [1]), delta(2, [9])] for _ in range(4)]  # 1 is missing
    pool, stub, watcher = await follow(gaps, backoff=Backoff(first_s=0.25, max_s=5.0, jitter=0.0))
    try:
        await until(lambda: len(stub.calls) == 5)
        # The first at once (the replica is up, only the view is off); then 0.5, 1, 2 s.
        assert slept.delays == [0.5, 1.0, 2.0]
    finally:
        await watcher.stop()
        await pool.close()


async def test_events_past_the_replicas_capacity_drop_its_entry_with_one_warning(
    slept: RecordedSleep, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="llmmesh.router.kv_events")
    overflows = metrics.KV_RESYNCS.labels(reason="overflow")
    before = overflows._value.get()
    index = PrefixIndex()
    pool, stub, watcher = await follow(
        [
            [snapshot("i1", 0, [1, 2, 3]), delta(1, [4, 5])],  # 5 blocks in a 4-block cache
            [snapshot("i1", 1, [1, 2, 3, 4, 5, 6])],  # its snapshot says as much
            [snapshot("i1", 2, [1, 2])],  # a snapshot that fits: precise again
        ],
        index=index,
        backoff=Backoff(first_s=0.25, max_s=5.0, jitter=0.0),
    )
    replica = pool.replicas[ADDRESS]
    replica.last_load = inference_pb2.LoadReport(kv_blocks_total=4)
    try:
        await until(lambda: len(stub.calls) == 3 and index.is_precise(ADDRESS))
        assert overflows._value.get() == before + 2
        assert slept.delays == [0.25, 0.5]  # backed off, as a broken stream is
        assert index.block_count(ADDRESS) == 2 and replica.kv_events_live
        lines = [r for r in caplog.records if "over the 4 it can hold" in r.getMessage()]
        assert [r.levelno for r in lines] == [logging.WARNING, logging.DEBUG]
        assert ADDRESS in lines[0].getMessage()
    finally:
        await watcher.stop()
        await pool.close()


async def test_a_message_the_index_refuses_is_said_and_the_watcher_goes_on(
    slept: RecordedSleep, caplog: pytest.LogCaptureFixture
) -> None:
    """A snapshot with block size 0 raised out of the watcher task, which ended for good without
    a word: the replica's prefix placement stayed approximate until the router restarted."""
    caplog.set_level(logging.DEBUG, logger="llmmesh.router.kv_events")
    invalid = metrics.KV_RESYNCS.labels(reason="invalid")
    before = invalid._value.get()
    index = PrefixIndex()
    bad = snapshot("i1", 0, [1, 2])
    bad.snapshot.block_size = 0
    pool, stub, watcher = await follow(
        [[bad], [bad], [snapshot("i1", 1, [1, 2, 3])]],
        index=index,
        backoff=Backoff(first_s=0.25, max_s=5.0, jitter=0.0),
    )
    try:
        await until(lambda: len(stub.calls) == 3 and index.is_precise(ADDRESS))
        assert index.block_count(ADDRESS) == 3 and pool.replicas[ADDRESS].kv_events_live
        assert invalid._value.get() == before + 2 and slept.delays == [0.25, 0.5]
        lines = [r for r in caplog.records if "refused: block_size must be > 0" in r.getMessage()]
        assert [r.levelno for r in lines] == [logging.WARNING, logging.DEBUG]
    finally:
        await watcher.stop()
        await pool.close()


class DrainingReplica(inference_pb2_grpc.InferenceServicer):
    """A replica that drains, as services/inference/servicer.py answers WatchKvEvents then: its
    watcher (``kv_watch.watch_kv_events``, the replica's own) sends a snapshot and ends."""

    def __init__(self) -> None:
        self.log = KvEventLog(block_size=16)
        self.stopping = asyncio.Event()
        self.stopping.set()
        self.subscriptions = 0

    async def WatchKvEvents(
        self, request: inference_pb2.WatchKvEventsRequest, context: Any
    ) -> AsyncIterator[inference_pb2.KvEvents]:
        self.subscriptions += 1
        async for snap, _ in watch_kv_events(self.log, self.stopping):
            assert snap is not None
            yield inference_pb2.KvEvents(
                snapshot=inference_pb2.KvSnapshot(
                    incarnation=snap.incarnation, sequence=snap.sequence, block_size=snap.block_size
                )
            )


async def test_a_real_draining_replica_is_not_hammered() -> None:
    """Over gRPC, for 0.6 s, with a 10 ms first wait doubling to 80 ms: about 10 subscriptions
    (10 + 20 + 40 + 80 ms, then one per 80 ms). Reset on each snapshot it was one per ~10 ms."""
    servicer = DrainingReplica()  # type: ignore[abstract]  # only WatchKvEvents is called
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = ReplicaPool(NoStreams)
    pool.set_addresses([f"127.0.0.1:{port}"])
    watcher = KvEventsConsumer(pool, PrefixIndex(), Backoff(first_s=0.01, max_s=0.08, jitter=0.0))
    watcher.start()
    try:
        await until(lambda: servicer.subscriptions >= 3)  # it does come back, at its pace
        await real_sleep(0.6)
        assert servicer.subscriptions <= 16
    finally:
        await watcher.stop()
        await pool.close()
        await server.stop(None)
