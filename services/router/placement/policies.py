"""Balancing policies: small pure classes that pick one replica from the eligible ones.

Each policy takes an injected random source (and the latency stats an injected
clock), so tests control chance and time. No grpc or asyncio in here.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from services.router.placement.ring import DEFAULT_EPSILON, ConsistentHashRing, bounded_capacity

POLICY_NAMES = ("auto", "affinity", "wrt", "least", "p2c", "round_robin")


class Candidate(Protocol):
    """What a policy may know about a replica."""

    @property
    def address(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def ewma_ttft_s(self) -> float | None: ...

    @property
    def ewma_itl_s(self) -> float | None: ...


C = TypeVar("C", bound=Candidate)


class LatencyEwma:
    """Exponentially weighted moving average that forgets when no sample arrives.

    A replica that was slow once would otherwise never be picked again and never
    get a chance to show it recovered; after ``stale_after_s`` without samples
    its value reads as unknown, which the balancer treats as average.
    """

    def __init__(
        self, alpha: float = 0.3, stale_after_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._value: float | None = None
        self._updated = 0.0

    def observe(self, sample: float) -> None:
        if self._value is None or self._clock() - self._updated > self.stale_after_s:
            self._value = sample
        else:
            self._value += self.alpha * (sample - self._value)
        self._updated = self._clock()

    @property
    def value(self) -> float | None:
        if self._value is None or self._clock() - self._updated > self.stale_after_s:
            return None
        return self._value

    @property
    def last_sample_at(self) -> float | None:
        """When the last sample arrived (on this EWMA's clock); None before the first."""
        return None if self._value is None else self._updated


class BalancingPolicy(Protocol):
    """Picks a replica; ``session_key`` is only used by affinity."""

    name: str

    def choose(self, candidates: Sequence[C], session_key: str | None = None) -> C | None: ...

    def accepts_pin(self, pinned: Candidate, candidates: Sequence[Candidate]) -> bool:
        """Whether a session pinned to ``pinned`` (one of ``candidates``) may stay there."""
        ...


class HonoursPins:
    """For a policy without a load bound: a session's pinned replica always keeps it."""

    def accepts_pin(self, pinned: Candidate, candidates: Sequence[Candidate]) -> bool:
        return True


def outstanding(c: Candidate) -> int:
    """Work ahead of a new request on this replica, as this router sees it plus what it reports."""
    return c.in_flight + c.queue_depth


class RoundRobinPolicy(HonoursPins):
    """Each replica in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[C], session_key: str | None = None) -> C | None:
        if not candidates:
            return None
        return candidates[next(self._counter) % len(candidates)]


class LeastOutstandingPolicy(HonoursPins):
    """The replica with the fewest outstanding requests; ties broken at random."""

    name = "least"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[C], session_key: str | None = None) -> C | None:
        if not candidates:
            return None
        best = min(outstanding(c) for c in candidates)
        tied = [c for c in candidates if outstanding(c) == best]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


class PowerOfTwoChoicesPolicy(HonoursPins):
    """Two replicas drawn at random; the less loaded one wins (Mitzenmacher)."""

    name = "p2c"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[C], session_key: str | None = None) -> C | None:
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        a, b = self._rng.sample(range(len(candidates)), 2)
        first, second = candidates[a], candidates[b]
        return second if outstanding(second) < outstanding(first) else first


@dataclass(frozen=True)
class ResponseTimeModel:
    """How WRT turns latency stats and load into an expected response time."""

    #: Tokens of a typical answer: weighs per-token latency against TTFT.
    expected_tokens: int = 32
    #: Used when no replica has a sample yet.
    default_ttft_s: float = 0.05
    default_itl_s: float = 0.01


class WeightedResponseTimePolicy(HonoursPins):
    """Random pick weighted by 1 / expected response time.

    Expected time = (EWMA TTFT + EWMA inter-token latency × typical tokens) ×
    (1 + outstanding work), so a replica twice as slow, or with twice the
    queue, gets about half the share: slower replicas get proportionally less,
    but never nothing, which keeps their stats fresh.
    """

    name = "wrt"

    def __init__(self, rng: random.Random | None = None, model: ResponseTimeModel | None = None) -> None:
        self._rng = rng or random.Random()
        self.model = model or ResponseTimeModel()

    def expected_seconds(self, candidates: Sequence[C]) -> list[float]:
        m = self.model
        known_ttft = [c.ewma_ttft_s for c in candidates if c.ewma_ttft_s is not None]
        known_itl = [c.ewma_itl_s for c in candidates if c.ewma_itl_s is not None]
        # A replica without samples counts as average, so newcomers get a fair share.
        mean_ttft = sum(known_ttft) / len(known_ttft) if known_ttft else m.default_ttft_s
        mean_itl = sum(known_itl) / len(known_itl) if known_itl else m.default_itl_s
        out = []
        for c in candidates:
            ttft = c.ewma_ttft_s if c.ewma_ttft_s is not None else mean_ttft
            itl = c.ewma_itl_s if c.ewma_itl_s is not None else mean_itl
            out.append(max(1e-6, ttft + itl * m.expected_tokens) * (1 + outstanding(c)))
        return out

    def choose(self, candidates: Sequence[C], session_key: str | None = None) -> C | None:
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        weights = [1.0 / s for s in self.expected_seconds(candidates)]
        pick = self._rng.random() * sum(weights)
        for c, w in zip(candidates, weights, strict=True):
            pick -= w
            if pick <= 0:
                return c
        return candidates[-1]


class AffinityPolicy:
    """Consistent hashing on the session id with bounded loads; another policy without one.

    Composed, not copied: the load-based fallback is any other policy.
    """

    name = "affinity"

    def __init__(
        self, fallback: BalancingPolicy, epsilon: float = DEFAULT_EPSILON, vnodes: int = 160
    ) -> None:
        if epsilon < 0 or not math.isfinite(epsilon):
            raise ValueError("epsilon must be a finite number >= 0")
        self.fallback = fallback
        self.epsilon = epsilon
        self.ring = ConsistentHashRing(vnodes=vnodes)

    def choose(self, candidates: Sequence[C], session_key: str | None = None) -> C | None:
        if not session_key:
            return self.fallback.choose(candidates, None)
        if not candidates:
            return None
        by_address = {c.address: c for c in candidates}
        self.ring.sync(by_address)
        address = self.ring.choose_bounded(session_key, lambda a: by_address[a].in_flight, self.epsilon)
        return by_address[address] if address is not None else self.fallback.choose(candidates, None)

    def within_bound(self, chosen: Candidate, candidates: Sequence[Candidate]) -> bool:
        """Whether ``chosen`` (e.g. a pinned replica) may take one more under the load cap."""
        total = sum(c.in_flight for c in candidates)
        return chosen.in_flight < bounded_capacity(total, len(candidates), self.epsilon)

    def accepts_pin(self, pinned: Candidate, candidates: Sequence[Candidate]) -> bool:
        """A pin holds while its replica is within the bounded load, as the ring's own choice does."""
        return self.within_bound(pinned, candidates)


def make_policy(
    name: str, rng: random.Random | None = None, epsilon: float = DEFAULT_EPSILON
) -> BalancingPolicy:
    """The policy for ``--policy``: ``auto`` is affinity over weighted response time."""
    rng = rng or random.Random()
    if name in ("auto", "affinity"):
        return AffinityPolicy(WeightedResponseTimePolicy(rng), epsilon)
    if name == "wrt":
        return WeightedResponseTimePolicy(rng)
    if name == "least":
        return LeastOutstandingPolicy(rng)
    if name == "p2c":
        return PowerOfTwoChoicesPolicy(rng)
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"--policy: unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
