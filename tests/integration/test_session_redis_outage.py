"""The session service when Redis dies or stalls: UNAVAILABLE fast, NOT_SERVING, then recovery by itself."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer
from tests.support.session_client import SessionClient, turn

TIMEOUT_MS = 500
# The configured bound plus room for a loaded CI machine; a hang would take the client's 10 s.
FAIL_FAST_S = TIMEOUT_MS / 1000 + 0.7
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture()
def session_service(redis_server: RedisServer) -> Iterator[ServiceProcess]:
    flags = [
        "--redis-url",
        redis_server.url,
        "--redis-timeout-ms",
        str(TIMEOUT_MS),
        "--redis-ping-interval-ms",
        "200",
    ]
    service = ServiceProcess("services.session", flags)
    try:
        yield service.start(timeout=60)
    finally:
        service.kill()


@pytest.fixture()
async def client(session_service: ServiceProcess) -> AsyncIterator[SessionClient]:
    async with grpc.aio.insecure_channel(session_service.address) as channel:
        yield SessionClient(channel, "tenant-ops", timeout=10)


async def wait_health(service: ServiceProcess, status: int, within_s: float) -> float:
    """Seconds until the service reports ``status``; fails after ``within_s``."""
    started = time.monotonic()
    while (await asyncio.to_thread(service.health)) != status:
        assert time.monotonic() - started < within_s, f"health never became {status}:\n{service.output()}"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def assert_unavailable_fast(calls: list[Callable[[], Awaitable[object]]]) -> None:
    for call in calls:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call()
        elapsed = time.monotonic() - started
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert "session store unavailable" in (info.value.details() or "")
        assert elapsed < FAIL_FAST_S, f"took {elapsed:.2f}s"


async def test_redis_killed_mid_traffic_then_restarted_loses_no_acknowledged_turn(
    redis_server: RedisServer, session_service: ServiceProcess, client: SessionClient
) -> None:
    await client.create("durable")
    acknowledged: list[str] = []
    failures: list[tuple[grpc.StatusCode, float]] = []
    stop = asyncio.Event()

    async def writer() -> None:
        n = 0
        while not stop.is_set():
            content, n = f"turn {n}", n + 1
            started = time.monotonic()
            try:
                await client.append("durable", [turn(content)])
                acknowledged.append(content)
            except grpc.aio.AioRpcError as error:
                failures.append((error.code(), time.monotonic() - started))
            await asyncio.sleep(0.01)

    writing = asyncio.create_task(writer())
    try:
        while len(acknowledged) < 20:
            await asyncio.sleep(0.02)
        await asyncio.to_thread(redis_server.kill)
        acknowledged_before_kill = len(acknowledged)

        await assert_unavailable_fast(
            [
                lambda: client.get("durable"),
                lambda: client.touch("durable"),
                lambda: client.create(),
                client.list,
            ]
        )
        await wait_health(session_service, NOT_SERVING, within_s=3)

        await asyncio.to_thread(redis_server.start)  # same port, same AOF file
        await wait_health(session_service, SERVING, within_s=10)
        while len(acknowledged) < acknowledged_before_kill + 5:  # the writer's appends land again
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await writing

    assert failures and {code for code, _ in failures} == {grpc.StatusCode.UNAVAILABLE}
    assert max(elapsed for _, elapsed in failures) < FAIL_FAST_S
    stored = [t.content for t in (await client.get("durable")).turns]
    # Every acknowledged turn survived, in order; at most the one in flight at the kill is extra.
    assert [content for content in stored if content in set(acknowledged)] == acknowledged
    assert len(stored) - len(acknowledged) <= 1
    assert session_service.proc is not None and session_service.proc.poll() is None  # never restarted


async def test_stalled_redis_gives_unavailable_within_the_timeout_not_a_hang(
    redis_server: RedisServer, session_service: ServiceProcess, client: SessionClient
) -> None:
    await client.create("stalled", system_prompt="hello")
    await client.append("stalled", [turn("before the stall")])
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        await assert_unavailable_fast(
            [lambda: client.get("stalled"), lambda: client.append("stalled", [turn("during")])]
        )
        await wait_health(session_service, NOT_SERVING, within_s=3)
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    await wait_health(session_service, SERVING, within_s=5)
    # Connections cut mid-reply were dropped, not reused: every answer matches its own request.
    for _ in range(5):
        state = await client.get("stalled")
        assert state.info.session_id == "stalled" and state.info.system_prompt == "hello"
    contents = [t.content for t in state.turns]
    assert contents[0] == "before the stall" and set(contents) <= {"before the stall", "during"}
