"""The router's KV-events consumer against scripted streams (no servers): resyncs, forgets, backs off."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import grpc
import pytest

from services.gen.llmmesh.v1 import inference_pb2
from services.router import metrics
from services.router.placement.kv_events import Backoff, KvEventsConsumer
from services.router.placement.pool import ReplicaPool

ADDRESS = "10.0.0.1:50052"
#: In a script: the replica ends the stream (OK), as it does when it drains.
END = "end"
Script = list[inference_pb2.KvEvents | grpc.aio.AioRpcError | str]


def snapshot(incarnation: str, sequence: int, hashes: Iterable[int]) -> inference_pb2.KvEvents:
    return inference_pb2.KvEvents(
        snapshot=inference_pb2.KvSnapshot(
            incarnation=incarnation, sequence=sequence, block_size=16, block_hashes=list(hashes)
        )
    )


def delta(sequence: int, stored: Sequence[int] = (), evicted: Sequence[int] = ()) -> inference_pb2.KvEvents:
    return inference_pb2.KvEvents(
        deltas=[inference_pb2.KvDelta(sequence=sequence, stored=stored, evicted=evicted)]
    )


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class FakeIndex:
    """The prefix index's event side, with its contract: a delta out of sequence or from
    another incarnation is refused (False)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[str, int, set[int]]] = {}
        self.forgotten: list[str] = []

    def apply_snapshot(
        self,
        replica: str,
        incarnation: str,
        sequence: int,
        block_size: int,
        block_hashes: Iterable[int],
        capacity: int = 0,
    ) -> None:
        self.entries[replica] = (incarnation, sequence, set(block_hashes))

    def apply_delta(
        self,
        replica: str,
        incarnation: str,
        sequence: int,
        stored: Sequence[int],
        evicted: Sequence[int],
        capacity: int = 0,
    ) -> bool:
        entry = self.entries.get(replica)
        if entry is None or entry[0] != incarnation or sequence != entry[1] + 1:
            return False
        blocks = (entry[2] - set(evicted)) | set(stored)
        self.entries[replica] = (incarnation, sequence, blocks)
        return True

    def forget(self, replica: str) -> None:
        self.entries.pop(replica, None)
        self.forgotten.append(replica)

    def block_count(self, replica: str) -> int:
        entry = self.entries.get(replica)
        return len(entry[2]) if entry else 0

    def blocks(self, replica: str) -> set[int]:
        entry = self.entries.get(replica)
        return entry[2] if entry else set()


class FakeCall:
    """One WatchKvEvents call: its scripted messages, then it stays open until cancelled."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[inference_pb2.KvEvents]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[inference_pb2.KvEvents]:
        for item in self.script:
            await asyncio.sleep(0)
            if isinstance(item, grpc.aio.AioRpcError):
                raise item
            if item == END:
                return
            assert isinstance(item, inference_pb2.KvEvents)
            yield item
        await asyncio.Event().wait()

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeStub:
    def __init__(self, scripts: list[Script]) -> None:
        self.scripts = scripts
        self.calls: list[FakeCall] = []

    def WatchKvEvents(self, request: inference_pb2.WatchKvEventsRequest) -> FakeCall:
        call = FakeCall(self.scripts.pop(0) if self.scripts else [])
        self.calls.append(call)
        return call


class NoStreams:
    def __init__(self, stub: Any, address: str) -> None: ...

    def open(self, start: Any, timeout_s: float | None) -> Any:
        raise AssertionError("no generations here")

    async def close(self) -> None: ...


async def until(condition: Any, timeout_s: float = 2.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.001)


async def start(scripts: list[Script]) -> tuple[ReplicaPool, FakeIndex, FakeStub, KvEventsConsumer]:
    pool = ReplicaPool(NoStreams)
    pool.set_addresses([ADDRESS])
    stub = FakeStub(scripts)
    pool.replicas[ADDRESS].stub = stub  # type: ignore[assignment]
    index = FakeIndex()
    consumer = KvEventsConsumer(pool, index, Backoff(first_s=0.001, max_s=0.002))
    consumer.start()
    return pool, index, stub, consumer


@pytest.mark.asyncio
async def test_snapshot_then_deltas_build_the_replicas_entry() -> None:
    pool, index, _, consumer = await start([[snapshot("i1", 4, [1, 2]), delta(5, [3], [1]), delta(6, [9])]])
    try:
        await until(lambda: index.blocks(ADDRESS) == {2, 3, 9})
        replica = pool.replicas[ADDRESS]
        assert replica.kv_events_live and replica.kv_block_size == 16
        assert metrics.KV_INDEX_BLOCKS.labels(replica=ADDRESS)._value.get() == 3
    finally:
        await consumer.stop()
        await pool.close()


@pytest.mark.asyncio
async def test_a_gap_in_sequence_numbers_resubscribes_for_a_fresh_snapshot() -> None:
    gaps = metrics.KV_RESYNCS.labels(reason="gap")
    before = gaps._value.get()
    pool, index, stub, consumer = await start(
        [[snapshot("i1", 0, [1]), delta(1, [2]), delta(3, [7])], [snapshot("i1", 3, [1, 2, 7, 8])]]
    )
    try:
        await until(lambda: index.blocks(ADDRESS) == {1, 2, 7, 8})
        assert len(stub.calls) == 2 and stub.calls[0].cancelled  # the first stream was dropped
        assert gaps._value.get() == before + 1
    finally:
        await consumer.stop()
        await pool.close()


@pytest.mark.asyncio
async def test_a_delta_the_index_refuses_as_another_incarnation_resyncs() -> None:
    # A new snapshot mid-stream from a restarted process, then a delta the index cannot place.
    class Refusing(FakeIndex):
        def apply_delta(self, replica: str, incarnation: str, sequence: int, *rest: Any) -> bool:
            return (
                False if incarnation == "old" else super().apply_delta(replica, incarnation, sequence, *rest)
            )

    pool = ReplicaPool(NoStreams)
    pool.set_addresses([ADDRESS])
    stub = FakeStub([[snapshot("old", 0, [1]), delta(1, [2])], [snapshot("new", 0, [5])]])
    pool.replicas[ADDRESS].stub = stub  # type: ignore[assignment]
    index = Refusing()
    consumer = KvEventsConsumer(pool, index, Backoff(first_s=0.001, max_s=0.002))
    consumer.start()
    try:
        await until(lambda: index.entries.get(ADDRESS, ("",))[0] == "new")
        assert index.blocks(ADDRESS) == {5} and len(stub.calls) == 2
    finally:
        await consumer.stop()
        await pool.close()


@pytest.mark.asyncio
async def test_a_broken_stream_forgets_the_entry_then_reconnects_to_the_new_incarnation() -> None:
    pool, index, stub, consumer = await start(
        [
            [snapshot("i1", 9, [1, 2, 3]), rpc_error(grpc.StatusCode.UNAVAILABLE)],
            [rpc_error(grpc.StatusCode.UNAVAILABLE)],  # still loading: backoff, again
            [snapshot("i2", 0, [])],
        ]
    )
    try:
        await until(lambda: len(stub.calls) == 3 and ADDRESS in index.entries)
        assert index.forgotten.count(ADDRESS) >= 2  # after each broken attempt
        assert index.entries[ADDRESS] == ("i2", 0, set())
        assert pool.replicas[ADDRESS].kv_events_live
    finally:
        await consumer.stop()
        await pool.close()


@pytest.mark.asyncio
async def test_an_older_replica_without_the_rpc_stays_approximate_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmmesh.router.kv_events")
    pool, index, stub, consumer = await start([[rpc_error(grpc.StatusCode.UNIMPLEMENTED)]])
    try:
        await until(lambda: len(stub.calls) == 1)
        await asyncio.sleep(0.02)  # several backoff periods: it must not be asked again
        assert len(stub.calls) == 1
        assert not pool.replicas[ADDRESS].kv_events_live
        # What the router sent there (its approximate entry) is kept, not forgotten.
        assert ADDRESS not in index.forgotten
        lines = [r for r in caplog.records if "WatchKvEvents" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO
    finally:
        await consumer.stop()
        await pool.close()


@pytest.mark.asyncio
async def test_a_replica_that_leaves_the_pool_is_forgotten_and_its_stream_closed() -> None:
    pool, index, stub, consumer = await start([[snapshot("i1", 0, [1])]])
    try:
        await until(lambda: ADDRESS in index.entries)
        pool.set_addresses([])
        await until(lambda: ADDRESS not in index.entries)
        await until(lambda: stub.calls[0].cancelled)
        assert ADDRESS in index.forgotten
    finally:
        await consumer.stop()
        await pool.close()


async def test_event_lag_is_the_routers_clock_minus_the_replicas_publish_time() -> None:
    pool = ReplicaPool(NoStreams)
    pool.set_addresses([ADDRESS])
    message = delta(1, [5])
    message.published_unix_ms = 1_000_000_000_000
    stub = FakeStub([[snapshot("i1", 0, []), message]])
    pool.replicas[ADDRESS].stub = stub  # type: ignore[assignment]
    index = FakeIndex()
    consumer = KvEventsConsumer(pool, index, wall_clock=lambda: 1_000_000_000.25)
    consumer.start()
    try:
        await until(lambda: index.blocks(ADDRESS) == {5})
        assert metrics.KV_EVENT_LAG.labels(replica=ADDRESS)._value.get() == pytest.approx(0.25)
    finally:
        await consumer.stop()
        await pool.close()
    # Gone with its replica: no stale series per address.
    assert ADDRESS not in {s.labels.get("replica") for m in metrics.KV_EVENT_LAG.collect() for s in m.samples}


async def test_a_stream_the_replica_ends_when_draining_forgets_it_until_a_new_snapshot() -> None:
    ended = metrics.KV_RESYNCS.labels(reason="ended")
    before = ended._value.get()
    pool, index, stub, consumer = await start(
        [[snapshot("i1", 0, [1, 2]), END], [rpc_error(grpc.StatusCode.UNAVAILABLE)]]
    )
    try:
        await until(lambda: len(stub.calls) >= 3)  # ended, refused while it restarts, then again
        assert ended._value.get() == before + 1
        assert ADDRESS in index.forgotten and index.block_count(ADDRESS) == 0
    finally:
        await consumer.stop()
        await pool.close()
