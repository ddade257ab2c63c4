"""Per-entry confidence for semantic-cache hits, in place of one global threshold (vCache's idea).

Every entry starts with a prior of one wrong answer in ``1 / error_budget`` (so a
new entry is served exactly at the budget) and learns from *refreshes*: a
would-be hit that the router answers fresh instead and compares with the cached
answer. A refresh happens for a random ``refresh_rate`` share of hits, and for
every lookup the entry's confidence refuses (those are answered fresh anyway).

An entry serves a hit only while both hold:

- the posterior mean of its error rate, ``(wrong + 1) / (refreshes + 1/ε)``, is at
  most the error budget ε, so served hits' expected false-hit rate stays within ε;
- the hit's similarity is above the highest similarity at which a refresh found
  it wrong (its own learned threshold: a nearer question than the one it failed
  can still be served once the entry has earned it back).

One wrong refresh therefore stops an entry at once; it needs about 1/ε agreeing
refreshes to serve again. With Redis the counts are shared by every router
(``llm:cache:semconf:{tenant}:{entry}``, one hash, kept as long as an entry can
live); each router also keeps what it saw in a bounded in-memory map, which is
the store without Redis, the fallback while Redis is down, and merged with
Redis's counts when it is up, so that what a router learned during an outage
is not lost when Redis returns (least recently used entries are forgotten
there, and start again from the prior).

An entry's first hit is served on the prior (or refreshed at the refresh rate):
see ``EntryConfidence.decide`` for why it is not forced to a refresh.
"""

from __future__ import annotations

import contextlib
import enum
import random
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common import errors
from services.router.admission.breaker import CircuitBreaker

DEFAULT_ERROR_BUDGET = 0.01
DEFAULT_REFRESH_RATE = 0.05
DEFAULT_MAX_ENTRIES = 100_000
# As long as a semantic entry may live (the retriever's MAX_TTL_SECONDS).
STATS_TTL_S = 30 * 24 * 3600
_WORD = re.compile(r"\w+")
# One refresh's outcome, atomically: count it, and raise the entry's learned threshold if wrong.
RECORD_LUA = """
redis.call('HINCRBY', KEYS[1], 'refreshes', 1)
if ARGV[1] == '0' then
  redis.call('HINCRBY', KEYS[1], 'wrong', 1)
  local at = tonumber(redis.call('HGET', KEYS[1], 'wrong_at') or '-2')
  if tonumber(ARGV[2]) > at then redis.call('HSET', KEYS[1], 'wrong_at', ARGV[2]) end
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""


class Decision(enum.Enum):
    SERVE = "serve"
    #: Confident enough, but picked for a refresh: answer fresh and compare.
    REFRESH = "refresh"
    #: Not confident: answer fresh (and compare, which is a refresh too).
    REFUSE = "refuse"


@dataclass
class EntryStats:
    refreshes: int = 0
    wrong: int = 0
    #: The highest similarity at which a refresh found this entry's answer wrong.
    wrong_at: float = -2.0

    def add(self, similarity: float, agreed: bool) -> None:
        self.refreshes += 1
        if not agreed:
            self.wrong += 1
            self.wrong_at = max(self.wrong_at, similarity)


def answers_agree(cached: str, fresh: str) -> bool:
    """Whether a fresh answer says what the cached one said: the same words, in any spacing or case."""
    return _WORD.findall(cached.lower()) == _WORD.findall(fresh.lower())


class EntryConfidence:
    """What each semantic-cache entry has shown, and whether it may serve the next hit."""

    def __init__(
        self,
        error_budget: float = DEFAULT_ERROR_BUDGET,
        refresh_rate: float = DEFAULT_REFRESH_RATE,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        rng: Callable[[], float] = random.random,
        redis: Any = None,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        if not 0.0 < error_budget < 1.0:
            raise ValueError(f"--semantic-cache-error-budget must be in (0, 1), got {error_budget}")
        if not 0.0 <= refresh_rate <= 1.0:
            raise ValueError(f"--semantic-cache-refresh-rate must be in [0, 1], got {refresh_rate}")
        if max_entries < 1:
            raise ValueError(f"max_entries: must be >= 1, got {max_entries}")
        self.error_budget = error_budget
        self.refresh_rate = refresh_rate
        self._max_entries = max_entries
        self._rng = rng
        self._local: OrderedDict[tuple[str, str], EntryStats] = OrderedDict()
        self.redis = redis
        self.breaker = breaker or CircuitBreaker("semantic-confidence")
        self._record = redis.register_script(RECORD_LUA) if redis is not None else None

    def estimated_error(self, stats: EntryStats | None) -> float:
        """The posterior mean of an entry's false-hit rate (the prior alone for an unseen entry)."""
        stats = stats or EntryStats()
        return (stats.wrong + 1) / (stats.refreshes + 1 / self.error_budget)

    async def stats(self, tenant: str, entry_id: str) -> EntryStats | None:
        """What is known of an entry: Redis's shared counts merged with this router's own.

        This router's record covers refreshes Redis never got (it was down when they
        were recorded), so it is never dropped for Redis's: each count is the larger of
        the two, and the learned threshold the higher. An entry this router found wrong
        during an outage therefore stays refused once Redis answers again (it has no
        key there, or one from before).
        """
        shared: EntryStats | None = None
        if self.redis is not None:
            with contextlib.suppress(errors.DependencyUnavailable):
                shared = await self._load(tenant, entry_id)
        local = self._local.get((tenant, entry_id))
        if local is None:
            return shared
        self._local.move_to_end((tenant, entry_id))
        if shared is None:
            return local
        return EntryStats(
            refreshes=max(shared.refreshes, local.refreshes),
            wrong=max(shared.wrong, local.wrong),
            wrong_at=max(shared.wrong_at, local.wrong_at),
        )

    async def decide(self, tenant: str, entry_id: str, similarity: float) -> Decision:
        """Serve, refresh or refuse one verified hit on an entry.

        An entry never refreshed is served (or refreshed at ``refresh_rate``) on the
        prior alone: its first hit is not forced to a refresh. That hit is what the
        verifier already judged; a forced refresh would answer every entry's first hit
        fresh — each pair of bench/semantic_cache.py is such a first hit — and, since
        agreement is the same words, a refreshed paraphrase a model words differently
        stops the entry (docs/router-frontdoor.md, "Response caches").
        """
        stats = await self.stats(tenant, entry_id)
        if stats is not None:
            # A tiny tolerance: the budget itself (1/(1/ε)) must not refuse for float rounding.
            over_budget = self.estimated_error(stats) > self.error_budget * (1 + 1e-9)
            if over_budget or similarity <= stats.wrong_at:
                return Decision.REFUSE
        if self.refresh_rate and self._rng() < self.refresh_rate:
            return Decision.REFRESH
        return Decision.SERVE

    async def record(self, tenant: str, entry_id: str, similarity: float, agreed: bool) -> None:
        """A refresh's outcome: the fresh answer agreed with the entry's, or not."""
        key = (tenant, entry_id)
        local = self._local.get(key)
        if local is None:
            local = self._local[key] = EntryStats()
            while len(self._local) > self._max_entries:
                self._local.popitem(last=False)
        self._local.move_to_end(key)
        local.add(similarity, agreed)
        if self._record is not None:
            script = self._record
            args = ["1" if agreed else "0", repr(similarity), STATS_TTL_S]
            # On an outage it is kept locally; the other routers learn it from their own refreshes.
            with contextlib.suppress(errors.DependencyUnavailable):
                await self.breaker.call(lambda: script(keys=[self.redis_key(tenant, entry_id)], args=args))

    @staticmethod
    def redis_key(tenant: str, entry_id: str) -> str:
        return f"llm:cache:semconf:{tenant}:{entry_id}"

    async def _load(self, tenant: str, entry_id: str) -> EntryStats | None:
        key = self.redis_key(tenant, entry_id)
        raw = await self.breaker.call(lambda: self.redis.hmget(key, "refreshes", "wrong", "wrong_at"))
        if raw[0] is None:
            return None
        return EntryStats(int(raw[0]), int(raw[1] or 0), float(raw[2]) if raw[2] is not None else -2.0)
