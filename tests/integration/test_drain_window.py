"""SIGTERM's drain window (--drain-seconds): the service says NOT_SERVING at once and keeps
taking work for the window, so callers that have not seen the health change yet (a router's
next poll, a Service's endpoints) are served, not refused; then it drains and exits."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from services.gen.llmmesh.v1 import inference_pb2, inference_pb2_grpc
from tests.support.inference import generate, greedy
from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_a_replica_told_to_stop_serves_new_work_through_its_drain_window() -> None:
    """The replica drained first and slept after: for the whole window it refused every new
    generation ("replica is shutting down"), which the routers that had not polled yet retried
    elsewhere, and a direct client saw as UNAVAILABLE."""
    replica = ServiceProcess("services.synthetic", ["--drain-seconds", "3", "--tokens-per-second", "200"])
    replica.start(timeout=120)
    try:
        replica.signal(signal.SIGTERM)
        deadline = time.monotonic() + 2
        while replica.health() != NOT_SERVING:
            assert time.monotonic() < deadline, "health never said NOT_SERVING"
            await asyncio.sleep(0.05)
        async with grpc.aio.insecure_channel(replica.address) as channel:
            start = inference_pb2.GenerateStart(prompt="still there?", sampling=greedy(4))
            served = await generate(inference_pb2_grpc.InferenceStub(channel), start, timeout=10)
        assert len(served.token_ids) == 4 and served.finished is not None
        assert replica.proc is not None and replica.proc.wait(30) == 0
    finally:
        replica.stop()


def test_a_session_service_stays_not_serving_through_its_drain_window(tmp_path: Path) -> None:
    """Its Redis watcher reports SERVING on every ping: during the window it must not take back
    the NOT_SERVING that shutdown set, or the endpoints would send it work again."""
    redis = RedisServer(tmp_path).start()
    session = ServiceProcess(
        "services.session",
        ["--redis-url", redis.url, "--drain-seconds", "3", "--redis-ping-interval-ms", "200"],
    )
    try:
        session.start(timeout=120)
        session.signal(signal.SIGTERM)
        time.sleep(0.3)
        seen = set()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # ten watcher pings inside the window
            seen.add(session.health())
            time.sleep(0.1)
        assert seen == {NOT_SERVING}
        assert session.proc is not None and session.proc.poll() is None  # still in its window
    finally:
        session.stop()
        redis.kill()


def test_the_routers_http_health_says_503_when_no_replica_serves_and_while_it_drains() -> None:
    """What an HTTP load balancer reads: /health said "ok" with its only replica dead (its model
    stayed known) and through the whole drain window, while gRPC health said NOT_SERVING."""
    import httpx

    from tests.support.openai_front import http_base
    from tests.support.router_mesh import synthetic_replica

    replica = synthetic_replica().start()
    router = ServiceProcess(
        "services.router",
        [
            "--replicas",
            replica.address,
            "--http-port",
            "0",
            "--health-interval-s",
            "0.2",
            "--drain-seconds",
            "3",
        ],
    )
    try:
        router.start()
        base = http_base(router)
        assert httpx.get(f"{base}/health", timeout=5).json() == {"status": "ok", "models": ["synthetic"]}
        replica.stop()  # the only replica gone: no turn can be placed
        deadline = time.monotonic() + 10
        while (answer := httpx.get(f"{base}/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.1)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_replica"
        router.signal(signal.SIGTERM)
        time.sleep(0.5)
        draining = httpx.get(f"{base}/health", timeout=5)  # in its drain window: still answering
        assert draining.status_code == 503 and draining.json()["error"]["code"] == "draining"
    finally:
        router.stop()
        replica.stop()
