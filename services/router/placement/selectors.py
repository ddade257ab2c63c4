"""The pipeline's last stage: from the candidates and their summed costs, the one replica.

Argmin (with a tie-break), a random draw weighted by 1 / cost (WRT), or the better of two
random draws (p2c). Randomness is injected; the deterministic tie-break is a hash of the
request's key with the replica's address, alike on every router. Pure: no grpc, no asyncio.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from services.router.placement.candidate import C
from services.router.placement.request import PlacementRequest
from services.router.placement.ring import ring_hash

#: Costs this close (relative) count as equal: float sums of the same terms may differ in the last bit.
TIE_TOLERANCE = 1e-9


class TieBreak(Protocol):
    """Which of several equally cheap candidates to take."""

    def pick(self, tied: Sequence[C], request: PlacementRequest) -> C: ...


class FirstTieBreak:
    """The first in the candidates' order (the scorers already ranked them uniquely)."""

    def pick(self, tied: Sequence[C], request: PlacementRequest) -> C:
        return tied[0]


class RandomTieBreak:
    """One at random, from the injected source."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, tied: Sequence[C], request: PlacementRequest) -> C:
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


class HashTieBreak:
    """Rendezvous hashing on the request's key: the same request breaks the same tie on every
    router, and different requests spread evenly over the tied replicas."""

    def pick(self, tied: Sequence[C], request: PlacementRequest) -> C:
        if len(tied) == 1:
            return tied[0]
        key = request.tie_key
        return min(tied, key=lambda c: (ring_hash(f"{key}|{c.address}"), c.address))


class Selector(Protocol):
    """Picks one of ``candidates`` given their costs (same order); None only when there are none."""

    def select(
        self, candidates: Sequence[C], costs: Sequence[float], request: PlacementRequest
    ) -> C | None: ...


class ArgMin:
    """The cheapest candidate; ties go to the tie-break."""

    def __init__(self, tie_break: TieBreak | None = None) -> None:
        self.tie_break: TieBreak = tie_break or FirstTieBreak()

    def select(self, candidates: Sequence[C], costs: Sequence[float], request: PlacementRequest) -> C | None:
        if not candidates:
            return None
        best = min(costs)
        slack = abs(best) * TIE_TOLERANCE
        tied = [c for c, cost in zip(candidates, costs, strict=True) if cost <= best + slack]
        return self.tie_break.pick(tied, request)


class WeightedRandom:
    """A random pick weighted by 1 / cost: twice the expected time, about half the share, but
    never nothing, which keeps a slow replica's stats fresh (WRT)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, candidates: Sequence[C], costs: Sequence[float], request: PlacementRequest) -> C | None:
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        weights = [1.0 / max(1e-12, cost) for cost in costs]
        pick = self._rng.random() * sum(weights)
        for c, w in zip(candidates, weights, strict=True):
            pick -= w
            if pick <= 0:
                return c
        return candidates[-1]


class TwoChoices:
    """Two candidates drawn at random; the cheaper one wins, the first on a tie (Mitzenmacher)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, candidates: Sequence[C], costs: Sequence[float], request: PlacementRequest) -> C | None:
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        a, b = self._rng.sample(range(len(candidates)), 2)
        return candidates[b] if costs[b] < costs[a] else candidates[a]
