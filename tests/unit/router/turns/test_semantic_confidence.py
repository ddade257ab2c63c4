"""Per-entry confidence: a wrong refresh stops an entry, agreeing ones earn it back, the budget sets both."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from services.router.admission.breaker import CircuitBreaker
from services.router.turns.semantic_confidence import Decision, EntryConfidence, EntryStats, answers_agree
from tests.support.redis import RedisServer

T = "acme"


async def test_a_new_entry_serves_and_one_wrong_refresh_stops_it() -> None:
    confidence = EntryConfidence(error_budget=0.01, refresh_rate=0.0)
    assert await confidence.decide(T, "e1", 0.95) is Decision.SERVE
    await confidence.record(T, "e1", 0.95, agreed=False)
    assert confidence.estimated_error(await confidence.stats(T, "e1")) > 0.01
    assert await confidence.decide(T, "e1", 0.99) is Decision.REFUSE
    assert await confidence.decide(T, "e2", 0.95) is Decision.SERVE  # other entries keep their own
    assert await confidence.decide("globex", "e1", 0.95) is Decision.SERVE  # and other tenants


async def test_an_entry_earns_serving_back_with_about_one_over_the_budget_agreeing_refreshes() -> None:
    confidence = EntryConfidence(error_budget=0.05, refresh_rate=0.0)
    await confidence.record(T, "e", 0.90, agreed=False)
    agreeing = 0
    while await confidence.decide(T, "e", 0.97) is Decision.REFUSE:
        await confidence.record(T, "e", 0.97, agreed=True)
        agreeing += 1
    # (1 + 1) / (refreshes + 20) <= 0.05 once refreshes reach 20: one wrong, 19 agreeing.
    assert agreeing == 19
    # Its own threshold stays: no longer served at or below the similarity it once failed at.
    assert await confidence.decide(T, "e", 0.90) is Decision.REFUSE
    assert await confidence.decide(T, "e", 0.91) is Decision.SERVE


async def test_a_looser_budget_tolerates_a_wrong_refresh_among_many_agreeing_ones() -> None:
    strict = EntryConfidence(error_budget=0.01, refresh_rate=0.0)
    loose = EntryConfidence(error_budget=0.2, refresh_rate=0.0)
    for confidence in (strict, loose):
        for _ in range(10):
            await confidence.record(T, "e", 0.9, agreed=True)
        await confidence.record(T, "e", 0.8, agreed=False)
    assert await strict.decide(T, "e", 0.95) is Decision.REFUSE
    assert await loose.decide(T, "e", 0.95) is Decision.SERVE


async def test_refreshes_are_drawn_at_the_refresh_rate() -> None:
    draws = iter([0.5, 0.01, 0.9])
    confidence = EntryConfidence(refresh_rate=0.05, rng=lambda: next(draws))
    decisions = [await confidence.decide(T, "e", 0.9) for _ in range(3)]
    assert decisions == [Decision.SERVE, Decision.REFRESH, Decision.SERVE]


async def test_the_least_recently_used_entries_are_forgotten_past_the_bound() -> None:
    confidence = EntryConfidence(refresh_rate=0.0, max_entries=2)
    for entry in ("old", "a", "b"):
        await confidence.record(T, entry, 0.9, agreed=False)
    assert await confidence.decide(T, "old", 0.95) is Decision.SERVE  # forgotten: back to the prior
    assert await confidence.decide(T, "b", 0.95) is Decision.REFUSE


async def test_routers_sharing_redis_share_what_each_entry_has_shown(redis_server: RedisServer) -> None:
    client = aioredis.from_url(redis_server.url)
    try:
        one, other = (EntryConfidence(refresh_rate=0.0, redis=client) for _ in range(2))
        await one.record(T, "e", 0.93, agreed=False)
        assert await other.decide(T, "e", 0.99) is Decision.REFUSE  # learnt on the other router
        stats = await other.stats(T, "e")
        assert stats is not None and (stats.refreshes, stats.wrong, stats.wrong_at) == (1, 1, 0.93)
        assert 0 < await client.ttl(EntryConfidence.redis_key(T, "e")) <= 30 * 24 * 3600
    finally:
        await client.aclose()


async def test_with_redis_down_a_router_goes_on_with_what_it_saw_itself(redis_server: RedisServer) -> None:
    client = aioredis.from_url(redis_server.url, socket_timeout=0.5)
    confidence = EntryConfidence(
        refresh_rate=0.0, redis=client, breaker=CircuitBreaker("t", failure_threshold=1)
    )
    try:
        redis_server.kill()
        await confidence.record(T, "e", 0.9, agreed=False)  # no error: kept locally
        assert await confidence.decide(T, "e", 0.95) is Decision.REFUSE
        assert await confidence.decide(T, "unseen", 0.95) is Decision.SERVE
    finally:
        await client.aclose()


async def test_a_wrong_refresh_during_a_redis_outage_is_kept_once_redis_is_back(
    redis_server: RedisServer,
) -> None:
    client = aioredis.from_url(redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    confidence = EntryConfidence(
        refresh_rate=0.0, redis=client, breaker=CircuitBreaker("t", failure_threshold=5)
    )
    try:
        redis_server.kill()
        await confidence.record(T, "e", 0.95, agreed=False)  # kept locally: Redis never hears of it
        assert await confidence.decide(T, "e", 0.99) is Decision.REFUSE
        redis_server.start()
        await asyncio.sleep(0.2)
        # Redis answers again, with no key for the entry: what this router saw still counts.
        assert await client.exists(EntryConfidence.redis_key(T, "e")) == 0
        assert await confidence.decide(T, "e", 0.99) is Decision.REFUSE
        stats = await confidence.stats(T, "e")
        assert stats is not None and (stats.refreshes, stats.wrong, stats.wrong_at) == (1, 1, 0.95)
    finally:
        await client.aclose()


async def test_local_and_shared_counts_merge_to_the_larger_of_each(redis_server: RedisServer) -> None:
    client = aioredis.from_url(redis_server.url)
    try:
        mine, other = (EntryConfidence(refresh_rate=0.0, redis=client) for _ in range(2))
        for _ in range(3):
            await other.record(T, "e", 0.9, agreed=True)  # shared: 3 agreeing refreshes
        mine._local[(T, "e")] = EntryStats(refreshes=1, wrong=1, wrong_at=0.97)  # seen in an outage
        stats = await mine.stats(T, "e")
        assert stats is not None and (stats.refreshes, stats.wrong, stats.wrong_at) == (3, 1, 0.97)
        assert await mine.decide(T, "e", 0.99) is Decision.REFUSE
        assert await other.decide(T, "e", 0.99) is Decision.SERVE  # it never saw the wrong one
    finally:
        await client.aclose()


async def test_a_first_hit_is_served_on_the_prior_and_refreshed_only_at_the_refresh_rate() -> None:
    # The choice documented in decide(): no forced refresh of an entry's first hit.
    draws = iter([0.06, 0.04])
    confidence = EntryConfidence(refresh_rate=0.05, rng=lambda: next(draws))
    assert await confidence.stats(T, "new") is None
    assert await confidence.decide(T, "new", 0.75) is Decision.SERVE
    assert await confidence.decide(T, "other", 0.75) is Decision.REFRESH


def test_answers_agree_on_the_same_words_only() -> None:
    assert answers_agree("Paris is the capital.", "paris  is the capital")
    assert not answers_agree("You can take it with water.", "You cannot take it with water.")


@pytest.mark.parametrize(("budget", "rate"), [(0.0, 0.1), (1.0, 0.1), (0.01, 1.5), (0.01, -0.1)])
def test_out_of_range_settings_are_refused_naming_the_flag(budget: float, rate: float) -> None:
    with pytest.raises(ValueError, match="--semantic-cache-"):
        EntryConfidence(error_budget=budget, refresh_rate=rate)
