"""Relay helpers without servers: chunk coalescing under backpressure, address parsing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.gen.llmmesh.v1 import inference_pb2
from services.router.pool import parse_address, parse_address_list
from services.router.relay import RelayConfig, coalesce_chunks
from services.router.turn import token_message


def chunk(index: int) -> inference_pb2.TokenChunk:
    return inference_pb2.TokenChunk(text=f" t{index}", token_ids=[index], index=index)


async def fake_replica_stream(
    n: int, fail_after: int | None = None
) -> AsyncIterator[inference_pb2.TokenChunk]:
    """A stand-in for the relay: n chunks as fast as the loop allows."""
    for i in range(n):
        if fail_after is not None and i == fail_after:
            raise ConnectionError("replica went away")
        yield chunk(i)
        await asyncio.sleep(0)


async def test_a_slow_consumer_gets_tokens_merged_in_order_and_none_lost() -> None:
    batches = []
    async for batch in coalesce_chunks(fake_replica_stream(50)):
        batches.append(batch)
        await asyncio.sleep(0.002)  # a client that reads slower than tokens arrive
    ids = [t for b in batches for c in b for t in c.token_ids]
    assert ids == list(range(50))
    assert len(batches) < 25  # merged: far fewer messages than tokens
    message = token_message("r1", 2, batches[1])
    assert (message.request_id, message.seq) == ("r1", 2)
    delta = message.delta
    assert delta.index == batches[1][0].index
    assert list(delta.token_ids) == [t for c in batches[1] for t in c.token_ids]
    assert delta.text == "".join(c.text for c in batches[1])
    single = token_message("r1", 1, batches[0][:1]).delta
    assert (single.text, list(single.token_ids), single.index) == (" t0", [0], 0)


async def test_a_fast_consumer_gets_every_chunk_on_its_own() -> None:
    batches = [b async for b in coalesce_chunks(fake_replica_stream(20))]
    assert [len(b) for b in batches] == [1] * 20


async def test_an_error_arrives_after_the_tokens_before_it() -> None:
    got = []
    with pytest.raises(ConnectionError, match="went away"):
        async for batch in coalesce_chunks(fake_replica_stream(10, fail_after=5)):
            got.extend(c.index for c in batch)
    assert got == [0, 1, 2, 3, 4]


async def test_a_consumer_that_stops_closes_the_source_at_once() -> None:
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[inference_pb2.TokenChunk]:
        try:
            i = 0
            while True:
                yield chunk(i)
                i += 1
                await asyncio.sleep(0.001)
        finally:
            closed.set()  # where the relay cancels the replica's call

    stream = coalesce_chunks(endless())
    await anext(stream)
    await stream.aclose()
    assert closed.is_set()


async def test_a_consumer_that_stops_reading_stops_the_source_at_the_bound() -> None:
    produced = 0

    async def endless() -> AsyncIterator[inference_pb2.TokenChunk]:
        nonlocal produced
        while True:
            yield chunk(produced)
            produced += 1
            await asyncio.sleep(0)

    stream = coalesce_chunks(endless(), max_pending=8)
    first = await anext(stream)
    await asyncio.sleep(0.05)  # the client reads nothing: the source must not run ahead unbounded
    assert produced <= len(first) + 8 + 1
    batch = await anext(stream)  # reading again lets the source continue, merged and in order
    assert [c.index for c in batch] == list(range(len(first), len(first) + len(batch)))
    assert len(batch) == 8
    await stream.aclose()


def test_addresses_are_validated() -> None:
    assert parse_address_list("a:1, b:2\n# comment\nc:3 # trailing") == ["a:1", "b:2", "c:3"]
    assert parse_address("[::1]:50052") == "[::1]:50052"
    for bad in ["nohost", "host:", "host:99999", ":80"]:
        with pytest.raises(ValueError, match="host:port"):
            parse_address(bad)


def test_relay_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="--max-attempts"):
        RelayConfig(max_attempts=0)


async def test_pick_refuses_when_the_predicted_queue_wait_exceeds_the_deadline() -> None:
    from services.common import errors
    from services.router.policies import AffinityPolicy, LeastOutstandingPolicy
    from services.router.pool import ReplicaPool
    from services.router.relay import Relay

    pool = ReplicaPool()
    # Channels connect lazily: no server is needed to build the pool.
    pool.set_addresses(["127.0.0.1:1", "127.0.0.1:2"])
    try:
        for replica in pool.replicas.values():
            replica.model, replica.serving = "m", True
            replica.ttft.observe(0.5)
            replica.last_load.waiting = 10  # ≈ 5 s before a new request would start
        relay = Relay(pool, AffinityPolicy(LeastOutstandingPolicy()), clock=lambda: 0.0)
        with pytest.raises(errors.DeadlineExceeded, match="predicted queue wait"):
            relay.pick(["m"], None, set(), deadline=1.0)
        picked = relay.pick(["m"], None, set(), deadline=60.0)
        assert picked is not None and picked[1] == "m"
        # A pinned replica keeps its session while it is within the load bound …
        assert relay.pick(["m"], "s", set(), None, preferred="127.0.0.1:2")[0].address == "127.0.0.1:2"  # type: ignore[index]
        # … and an excluded (failed) one is never picked again for this turn.
        again = relay.pick(["m"], "s", {"127.0.0.1:2"}, None, preferred="127.0.0.1:2")
        assert again is not None and again[0].address == "127.0.0.1:1"
    finally:
        await pool.close()


async def test_discovery_follows_the_replicas_file_and_dns(tmp_path: Path) -> None:
    import os

    from services.router.pool import ReplicaDiscovery, ReplicaPool

    path = tmp_path / "replicas.txt"
    path.write_text("127.0.0.1:7001\n127.0.0.1:7002  # second\n")
    pool = ReplicaPool()
    discovery = ReplicaDiscovery(pool, static=["127.0.0.1:7000"], dns="localhost:7100", file=str(path))
    try:
        await discovery.start()
        assert {"127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"} <= set(pool.replicas)
        assert any(a.endswith(":7100") for a in pool.replicas)  # localhost resolved
        path.write_text("127.0.0.1:7003\n")
        os.utime(path, (1, 1))  # a new mtime, whatever the file system's resolution
        assert discovery.read_file()
        discovery._apply()
        assert "127.0.0.1:7003" in pool.replicas and "127.0.0.1:7001" not in pool.replicas
        path.write_text("not an address\n")
        os.utime(path, (2, 2))
        assert not discovery.read_file()  # a broken file keeps the last good list
    finally:
        await discovery.stop()
        await pool.close()
