"""Rate limits in real Redis: a bursting key is refused with a retry-after, other keys are not touched."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.common import errors
from services.router.admission.auth import KeyLimits, Principal
from services.router.admission.ratelimit import InflightLimiter, RateLimiter
from tests.support.redis import RedisServer

BURSTY = Principal("acme", "acme-1", KeyLimits(requests_per_second=1, burst=3))
QUIET = Principal("acme", "acme-2", KeyLimits(requests_per_second=1, burst=3))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url, socket_timeout=5, socket_connect_timeout=2)
    yield client
    await client.aclose()


async def test_bursting_key_is_refused_with_retry_after_and_another_key_is_not(
    redis_client: aioredis.Redis,
) -> None:
    limiter = RateLimiter(redis_client)
    for _ in range(3):
        await limiter.admit_request(BURSTY)
    with pytest.raises(errors.Overloaded, match="rate limit exceeded for API key acme-1") as refused:
        await limiter.admit_request(BURSTY)
    assert 0 < refused.value.retry_after_s <= 1.0
    for _ in range(3):
        await limiter.admit_request(QUIET)


async def test_buckets_are_shared_by_routers_and_updated_atomically(redis_client: aioredis.Redis) -> None:
    # Two limiters on one Redis stand for two router instances racing for the same key.
    routers = [RateLimiter(redis_client), RateLimiter(redis_client)]
    key = Principal("acme", "shared", KeyLimits(requests_per_second=0.01, burst=10))
    outcomes = await asyncio.gather(
        *(routers[i % 2].admit_request(key) for i in range(40)), return_exceptions=True
    )
    assert sum(o is None for o in outcomes) == 10
    assert all(isinstance(o, errors.Overloaded) for o in outcomes if o is not None)


async def test_bucket_refills_at_the_configured_rate(redis_client: aioredis.Redis) -> None:
    clock = FakeClock()
    limiter = RateLimiter(redis_client, clock=clock, use_redis_time=False)
    key = Principal("acme", "refill", KeyLimits(requests_per_second=2, burst=2))
    await limiter.admit_request(key)
    await limiter.admit_request(key)
    with pytest.raises(errors.Overloaded) as refused:
        await limiter.admit_request(key)
    assert refused.value.retry_after_s == pytest.approx(0.5, abs=0.01)
    clock.now += 0.5
    await limiter.admit_request(key)
    with pytest.raises(errors.Overloaded):
        await limiter.admit_request(key)


async def test_token_debt_refuses_the_next_request_until_refilled(redis_client: aioredis.Redis) -> None:
    clock = FakeClock()
    limiter = RateLimiter(redis_client, clock=clock, use_redis_time=False)
    key = Principal("acme", "tokens", KeyLimits(tokens_per_minute=600))  # 10 tokens/s
    await limiter.admit_request(key)
    await limiter.record_tokens(key, 700)  # a long answer is charged in full: 100 tokens of debt
    with pytest.raises(errors.Overloaded, match="600 tokens/min") as refused:
        await limiter.admit_request(key)
    assert refused.value.retry_after_s == pytest.approx(10.1, abs=0.05)
    clock.now += 10.1
    await limiter.admit_request(key)


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "local"])
async def test_every_answer_is_charged_in_full_even_while_the_key_is_in_debt(
    redis_client: aioredis.Redis, shared: bool
) -> None:
    """Answers admitted together end together: each one's tokens are owed. A charge that found the
    bucket already in debt was dropped, so 30 parallel answers against a 600 tokens/min key left
    it at −15 instead of −600 (the audit's measurement)."""
    clock = FakeClock()
    limiter = RateLimiter(redis_client if shared else None, clock=clock, use_redis_time=False)
    key = Principal("acme", f"parallel-{shared}", KeyLimits(tokens_per_minute=600))  # 10 tokens/s
    for _ in range(3):
        await limiter.admit_request(key)  # all three admitted while the bucket is full
    for _ in range(3):
        await limiter.record_tokens(key, 500)  # then each ends: 1,500 owed, a debt of 900
    with pytest.raises(errors.Overloaded) as refused:
        await limiter.admit_request(key)
    assert refused.value.retry_after_s == pytest.approx(90.1, abs=0.05)


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "local"])
async def test_a_debt_past_a_minutes_budget_is_paid_in_full(
    redis_client: aioredis.Redis, shared: bool
) -> None:
    """A debt that stopped at one minute's budget forgave the rest: a key whose answers were each
    far past it got many times its tokens per minute (111,000 against 1,000, measured)."""
    clock = FakeClock()
    limiter = RateLimiter(redis_client if shared else None, clock=clock, use_redis_time=False)
    key = Principal("acme", f"huge-{shared}", KeyLimits(tokens_per_minute=600))  # 10 tokens/s
    await limiter.admit_request(key)
    await limiter.record_tokens(key, 6_600)  # 6,000 tokens of debt: ten minutes' budget
    with pytest.raises(errors.Overloaded) as refused:
        await limiter.admit_request(key)
    assert refused.value.retry_after_s == pytest.approx(600.1, abs=0.05)
    clock.now += 300
    with pytest.raises(errors.Overloaded):
        await limiter.admit_request(key)  # half-way: still in debt
    clock.now += 300.1
    await limiter.admit_request(key)


async def test_keys_without_limits_get_the_defaults_and_unlimited_keys_pass() -> None:
    limiter = RateLimiter(default_limits=KeyLimits(requests_per_second=1, burst=1))
    anonymous = Principal("default", "anonymous")
    await limiter.admit_request(anonymous)
    with pytest.raises(errors.Overloaded):
        await limiter.admit_request(anonymous)
    unlimited = RateLimiter()
    for _ in range(100):
        await unlimited.admit_request(anonymous)
    # Only a key with a token budget is charged for its answers.
    assert not unlimited.counts_tokens(anonymous)
    assert unlimited.counts_tokens(Principal("acme", "tokens", KeyLimits(tokens_per_minute=600)))


async def test_redis_outage_falls_back_to_local_buckets(redis_server: RedisServer) -> None:
    client = aioredis.from_url(redis_server.url, socket_connect_timeout=0.5)
    try:
        limiter = RateLimiter(client)
        await limiter.admit_request(BURSTY)
        redis_server.kill()
        for _ in range(3):
            await limiter.admit_request(BURSTY)
        with pytest.raises(errors.Overloaded):
            await limiter.admit_request(BURSTY)
    finally:
        await client.aclose()


def test_inflight_cap_refuses_at_once_and_frees_slots() -> None:
    limiter = InflightLimiter(2)
    refused = pytest.raises(errors.Overloaded, match="2 requests in flight")
    with limiter.slot(), limiter.slot(), refused, limiter.slot():
        pass
    assert limiter.in_flight == 0
    with limiter.slot():
        assert limiter.in_flight == 1


def test_invalid_limits_name_the_field() -> None:
    with pytest.raises(ValueError, match="requests_per_second: must be > 0"):
        KeyLimits(requests_per_second=0)
    with pytest.raises(ValueError, match="max-in-flight"):
        InflightLimiter(0)


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "local"])
async def test_several_requests_are_taken_all_or_none_and_past_the_burst_is_invalid(
    redis_client: aioredis.Redis, shared: bool
) -> None:
    """An OpenAI request with n choices takes n of the key's requests at once: a refusal spends
    none, and n past the burst, which no wait could ever admit, names the field instead of a 429."""
    clock = FakeClock()
    limiter = RateLimiter(redis_client if shared else None, clock=clock, use_redis_time=False)
    key = Principal("acme", f"choices-{shared}", KeyLimits(requests_per_second=1, burst=3))
    await limiter.admit_request(key, requests=2)
    with pytest.raises(errors.Overloaded) as refused:
        await limiter.admit_request(key, requests=2)  # one left: not enough for two
    assert refused.value.retry_after_s == pytest.approx(1.0, abs=0.01)
    await limiter.admit_request(key)  # the refusal took nothing: the one left is still there
    with pytest.raises(errors.InvalidArgument, match=r"^n: 4 requests at once .* burst of 3"):
        await limiter.admit_request(key, requests=4)
    with pytest.raises(errors.InvalidArgument, match=r"^prompt: "):
        await limiter.admit_request(key, requests=5, field="prompt")
