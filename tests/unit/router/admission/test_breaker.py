"""Circuit breaker: opens after repeated outages, probes after the reset timeout, ignores real answers."""

from __future__ import annotations

import grpc
import pytest

from services.common import errors
from services.router.admission.breaker import BreakerState, CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _fail() -> None:
    raise ConnectionError("connection refused")


async def _not_found() -> None:
    raise errors.NotFound("session s1 not found")


async def _ok() -> str:
    return "ok"


async def test_opens_after_threshold_and_refuses_without_calling() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("session", failure_threshold=3, reset_timeout_s=10, clock=clock)
    for _ in range(3):
        with pytest.raises(errors.DependencyUnavailable, match="session unavailable"):
            await breaker.call(_fail)
    assert breaker.state is BreakerState.OPEN

    calls = 0

    async def counted() -> str:
        nonlocal calls
        calls += 1
        return "ok"

    with pytest.raises(errors.DependencyUnavailable, match="circuit open"):
        await breaker.call(counted)
    assert calls == 0


async def test_half_open_probe_closes_on_success_and_reopens_on_failure() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("retriever", failure_threshold=1, reset_timeout_s=5, clock=clock)
    with pytest.raises(errors.DependencyUnavailable):
        await breaker.call(_fail)
    clock.now += 5
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow() is True
    assert breaker.allow() is False  # one probe at a time
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    clock.now += 5
    assert await breaker.call(_ok) == "ok"
    assert breaker.state is BreakerState.CLOSED


async def test_a_real_answer_is_not_an_outage() -> None:
    breaker = CircuitBreaker("session", failure_threshold=1, clock=FakeClock())
    for _ in range(3):
        with pytest.raises(errors.NotFound):
            await breaker.call(_not_found)
    assert breaker.state is BreakerState.CLOSED


async def test_grpc_unavailable_counts_and_is_reported_with_its_code() -> None:
    breaker = CircuitBreaker("retriever", failure_threshold=2, clock=FakeClock())
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # nothing listens on port 1
    try:
        call = channel.unary_unary("/x.Y/Z", request_serializer=None, response_deserializer=None)
        with pytest.raises(errors.DependencyUnavailable, match="UNAVAILABLE"):
            await breaker.call(lambda: call(b"", timeout=2))
    finally:
        await channel.close()
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN


def test_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker("x", failure_threshold=0)
