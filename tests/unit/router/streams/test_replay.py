"""Replay buffer in real Redis: resume after any seq gets each later message exactly once, live ones too."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.common import errors
from services.gen.llmmesh.v1 import router_pb2
from services.router.streams.replay import ReplayBuffer
from services.router.streams.replay_writer import ReplayWriter
from tests.support.redis import RedisServer


@pytest.fixture()
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url, socket_timeout=5, socket_connect_timeout=2)
    yield client
    await client.aclose()


async def collect(buffer: ReplayBuffer, request_id: str, tenant: str, last_seq: int) -> list[bytes]:
    return [p async for p in buffer.read_after(request_id, tenant, last_seq)]


async def test_replays_after_last_seq_then_follows_live_until_finished(redis_client: aioredis.Redis) -> None:
    buffer = ReplayBuffer(redis_client, poll_block_ms=50)
    for seq in range(1, 4):
        await buffer.append("r1", "acme", seq, f"m{seq}".encode())

    reader = asyncio.create_task(collect(buffer, "r1", "acme", 1))
    await asyncio.sleep(0.1)
    for seq in range(4, 7):
        await buffer.append("r1", "acme", seq, f"m{seq}".encode())
        await asyncio.sleep(0.02)
    await buffer.finish("r1", "acme")
    assert await asyncio.wait_for(reader, 5) == [b"m2", b"m3", b"m4", b"m5", b"m6"]
    # After the end it still replays, for a client that reconnects late.
    assert await collect(buffer, "r1", "acme", 5) == [b"m6"]
    assert await collect(buffer, "r1", "acme", 6) == []


async def test_a_retried_append_is_stored_once(redis_client: aioredis.Redis) -> None:
    buffer = ReplayBuffer(redis_client)
    assert await buffer.append("r2", "acme", 1, b"a") is True
    assert await buffer.append("r2", "acme", 1, b"a-again") is False
    await buffer.append("r2", "acme", 2, b"b")
    await buffer.finish("r2", "acme")
    assert await collect(buffer, "r2", "acme", 0) == [b"a", b"b"]


async def test_a_request_id_is_the_tenants_own(redis_client: aioredis.Redis) -> None:
    buffer = ReplayBuffer(redis_client)
    await buffer.append("r3", "acme", 1, b"secret")
    await buffer.finish("r3", "acme")
    with pytest.raises(errors.NotFound, match="unknown or expired"):
        await collect(buffer, "r3", "globex", 0)  # not the other tenant's to read, nor to know of
    # The other tenant's turn by the same id is its own, and takes none of the first's seqs.
    assert await buffer.append("r3", "globex", 1, b"globex's") is True
    await buffer.finish("r3", "globex")
    assert await collect(buffer, "r3", "globex", 0) == [b"globex's"]
    assert await collect(buffer, "r3", "acme", 0) == [b"secret"]
    with pytest.raises(errors.InvalidArgument, match="last_seq"):
        await collect(buffer, "r3", "acme", 10**12)
    with pytest.raises(errors.NotFound, match="unknown or expired"):
        await collect(buffer, "nope", "acme", 0)
    with pytest.raises(errors.InvalidArgument, match="last_seq"):
        await collect(buffer, "r3", "acme", -1)


async def test_buffer_is_bounded_and_expires(redis_client: aioredis.Redis) -> None:
    buffer = ReplayBuffer(redis_client, max_messages=3, ttl_s=1)
    for seq in range(1, 6):
        await buffer.append("r4", "acme", seq, str(seq).encode())
    await buffer.finish("r4", "acme")
    assert await collect(buffer, "r4", "acme", 2) == [b"3", b"4", b"5"]
    with pytest.raises(errors.FailedPrecondition, match="no longer buffered"):
        await collect(buffer, "r4", "acme", 0)
    await asyncio.sleep(1.2)
    with pytest.raises(errors.NotFound):
        await collect(buffer, "r4", "acme", 4)


async def test_reader_gives_up_on_a_writer_that_died(redis_client: aioredis.Redis) -> None:
    buffer = ReplayBuffer(redis_client, poll_block_ms=50, stall_timeout_s=0.3)
    await buffer.append("r5", "acme", 1, b"x")
    with pytest.raises(errors.DependencyUnavailable, match="stalled"):
        await collect(buffer, "r5", "acme", 0)


async def test_concurrent_turns_share_round_trips_yet_each_replays_in_order_once(
    redis_client: aioredis.Redis,
) -> None:
    buffer = ReplayBuffer(redis_client, poll_block_ms=50)
    writers = {f"turn-{i}": ReplayWriter(buffer, f"turn-{i}", "acme") for i in range(8)}
    sent: dict[str, list[router_pb2.ChatResponse]] = {rid: [] for rid in writers}
    calls_before = await script_calls(redis_client)
    for seq in range(1, 51):
        for rid, writer in writers.items():
            message = router_pb2.ChatResponse(
                request_id=rid, seq=seq, delta=router_pb2.TokenDelta(text=f" {seq}")
            )
            writer.put(message)
            sent[rid].append(message)
        if seq == 1:
            writers["turn-0"].put(sent["turn-0"][0])  # a retried message is stored once
        if seq % 10 == 0:
            await asyncio.sleep(0)  # flushes happen while the turns are still streaming
    await asyncio.gather(*(writer.close() for writer in writers.values()))
    for rid in writers:
        replayed = [router_pb2.ChatResponse.FromString(p) async for p in buffer.read_after(rid, "acme", 0)]
        assert replayed == sent[rid]
    # 400 messages in far fewer Redis calls: what piled up in every turn goes in one round trip.
    calls = await script_calls(redis_client) - calls_before
    assert 8 <= calls < 400 / 4


async def test_a_redis_that_forgot_the_append_script_still_gets_every_message(
    redis_client: aioredis.Redis,
) -> None:
    buffer = ReplayBuffer(redis_client)
    writer = ReplayWriter(buffer, "forgetful", "acme")
    sent = [
        router_pb2.ChatResponse(request_id="forgetful", seq=i, delta=router_pb2.TokenDelta(text=f" {i}"))
        for i in range(1, 11)
    ]
    for message in sent[:5]:
        writer.put(message)
    await asyncio.sleep(0.1)  # written
    await redis_client.script_flush()  # as after a Redis restart
    for message in sent[5:]:
        writer.put(message)
    await writer.close()
    replayed = [
        router_pb2.ChatResponse.FromString(p) async for p in buffer.read_after("forgetful", "acme", 0)
    ]
    assert replayed == sent


async def script_calls(client: aioredis.Redis) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
