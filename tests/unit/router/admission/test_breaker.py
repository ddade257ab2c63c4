"""Circuit breaker: opens after repeated outages, probes after the reset timeout, ignores real answers."""

from __future__ import annotations

import asyncio
import logging

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


# Timeouts: slow need not mean down. A call that ran out of time counts as an outage only when the
# dependency showed no sign of life since it began (no other answer, no answer to the liveness probe).


async def _time_out(released: asyncio.Event | None = None) -> None:
    if released is not None:
        await released.wait()
    raise TimeoutError


async def test_a_timeout_while_the_dependency_answered_others_does_not_count() -> None:
    breaker = CircuitBreaker("retriever", failure_threshold=1, clock=FakeClock())
    released = asyncio.Event()
    slow = asyncio.ensure_future(breaker.call(lambda: _time_out(released)))
    await asyncio.sleep(0)  # the slow call is out
    assert await breaker.call(_ok) == "ok"  # another call answered while it waited
    released.set()
    with pytest.raises(errors.DependencyUnavailable, match="not counted as an outage"):
        await slow
    assert breaker.state is BreakerState.CLOSED


async def test_timeouts_with_no_sign_of_life_still_open_the_breaker() -> None:
    """No other answer and no liveness probe: as before, a hung dependency opens it."""
    breaker = CircuitBreaker("session", failure_threshold=2, clock=FakeClock())
    for _ in range(2):
        with pytest.raises(errors.DependencyUnavailable, match="session unavailable: TimeoutError"):
            await breaker.call(_time_out)
    assert breaker.state is BreakerState.OPEN


async def test_a_burst_of_timeouts_shares_one_liveness_probe_and_an_answer_keeps_it_closed() -> None:
    breaker = CircuitBreaker("retriever", failure_threshold=2, clock=FakeClock())
    probes = 0

    async def probe() -> None:
        nonlocal probes
        probes += 1
        await asyncio.sleep(0.01)
        raise errors.NotFound("no such document")  # a real refusal is an answer too

    released = asyncio.Event()
    burst = [breaker.call(lambda: _time_out(released), liveness_probe=probe) for _ in range(5)]
    waiting = asyncio.gather(*burst, return_exceptions=True)
    await asyncio.sleep(0)
    released.set()
    results = await waiting
    assert all(isinstance(r, errors.DependencyUnavailable) for r in results), results
    assert probes == 1
    assert breaker.state is BreakerState.CLOSED


async def test_an_unanswered_liveness_probe_counts_the_timeout() -> None:
    breaker = CircuitBreaker("retriever", failure_threshold=2, clock=FakeClock())
    for _ in range(2):
        with pytest.raises(errors.DependencyUnavailable, match=r"retriever unavailable: TimeoutError$"):
            await breaker.call(_time_out, liveness_probe=_fail)
    assert breaker.state is BreakerState.OPEN


async def test_a_timed_out_half_open_call_closes_the_breaker_when_the_probe_is_answered() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("retriever", failure_threshold=1, reset_timeout_s=5, clock=clock)
    with pytest.raises(errors.DependencyUnavailable):
        await breaker.call(_fail)
    clock.now += 5
    assert breaker.state is BreakerState.HALF_OPEN
    with pytest.raises(errors.DependencyUnavailable, match="not counted"):
        await breaker.call(_time_out, liveness_probe=_ok)
    assert breaker.state is BreakerState.CLOSED


async def test_other_outages_count_whatever_the_probe_says() -> None:
    """Only a timeout can be the call's own cost; a refused connection is the dependency's."""
    breaker = CircuitBreaker("retriever", failure_threshold=1, clock=FakeClock())
    with pytest.raises(errors.DependencyUnavailable):
        await breaker.call(_fail, liveness_probe=_ok)
    assert breaker.state is BreakerState.OPEN


async def test_an_outage_is_told_to_callers_by_its_kind_and_to_operators_in_full(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The Redis client's text ("Error 111 connecting to 10.0.0.5:6379") reached clients in the
    # status and in TurnEnd.degraded_reasons: the mesh's internal addresses, for every tenant.
    import redis.exceptions

    async def refused() -> None:
        raise redis.exceptions.ConnectionError("Error 111 connecting to 10.0.0.5:6379. Connection refused.")

    breaker = CircuitBreaker("redis", failure_threshold=1, clock=FakeClock())
    caplog.set_level(logging.WARNING, logger="llmmesh.router.breaker")
    with pytest.raises(errors.DependencyUnavailable) as told:
        await breaker.call(refused)
    assert str(told.value) == "redis unavailable: ConnectionError"
    assert "10.0.0.5:6379" in caplog.text and "circuit redis open" in caplog.text
