"""The session service's Redis health watcher when Redis answers PING with an error it does not
classify (NOPERM after an ACL change): NOT_SERVING while it does, and a clean drain at SIGTERM.

Until 2026-12-07 only DependencyUnavailable counted as unreachable: any other error ended the
watcher task silently (health SERVING for good), and SIGTERM re-raised it from the drain, so the
server's graceful stop never ran: in-flight RPCs were cut and the process died with a traceback.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2

from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer
from tests.support.session_client import SessionClient, turn

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PING_INTERVAL_MS = 100


@pytest.fixture()
def admin(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture()
def session_service(redis_server: RedisServer) -> Iterator[ServiceProcess]:
    flags = ["--redis-url", redis_server.url, "--redis-ping-interval-ms", str(PING_INTERVAL_MS)]
    # Room for a call that Redis holds back (CLIENT PAUSE) to finish instead of timing out.
    service = ServiceProcess("services.session", [*flags, "--redis-timeout-ms", "5000"])
    try:
        yield service.start(timeout=60)
    finally:
        service.kill()


@pytest.fixture()
async def client(session_service: ServiceProcess) -> AsyncIterator[SessionClient]:
    async with grpc.aio.insecure_channel(session_service.address) as channel:
        yield SessionClient(channel, "tenant-ops", timeout=20)


def refuse_ping(admin: redis.Redis, refused: bool) -> None:
    """What an ACL change does to the service's Redis user: PING answered with NOPERM."""
    admin.execute_command("ACL", "SETUSER", "default", "-ping" if refused else "+ping")


async def wait_health(service: ServiceProcess, status: int, within_s: float) -> None:
    started = time.monotonic()
    while (await asyncio.to_thread(service.health)) != status:
        assert time.monotonic() - started < within_s, f"health never became {status}:\n{service.output()}"
        await asyncio.sleep(0.05)


async def test_a_ping_redis_refuses_is_not_serving_and_the_watch_goes_on(
    session_service: ServiceProcess, admin: redis.Redis
) -> None:
    for _ in range(2):  # and again: the first refusal did not end the watch
        refuse_ping(admin, True)
        await wait_health(session_service, NOT_SERVING, within_s=5)
        refuse_ping(admin, False)
        await wait_health(session_service, SERVING, within_s=5)
    assert "NoPermissionError" in session_service.output()  # said why, once a spell


async def test_sigterm_after_a_refused_ping_still_finishes_the_calls_in_flight(
    session_service: ServiceProcess, client: SessionClient, admin: redis.Redis
) -> None:
    await client.create("in-flight")
    refuse_ping(admin, True)
    await asyncio.sleep(10 * PING_INTERVAL_MS / 1000)  # several checks refused
    admin.execute_command("CLIENT", "PAUSE", "3000", "WRITE")  # holds the next script back
    append = asyncio.create_task(client.append("in-flight", [turn("answered during the drain")]))
    await asyncio.sleep(0.4)
    assert not append.done()
    session_service.signal(signal.SIGTERM)

    done = await append  # the graceful stop waits for it
    assert done.version == 1 and done.info.turn_count == 1
    assert session_service.proc is not None
    code = await asyncio.to_thread(session_service.proc.wait, 30)
    output = session_service.output()
    assert code == 0, output
    assert "Traceback" not in output and "session stopped" in output, output
    # And it was stored, not only answered (read back past the service, which is gone).
    stored = list(admin.scan_iter("llm:session:{in-flight}*turns"))
    assert len(stored) == 1 and "answered during the drain" in admin.lrange(stored[0], 0, -1)[0]
