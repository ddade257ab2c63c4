"""The pipeline's first stage: which replicas may take the request at all.

Model, health and ejection are the pool's to know (``CandidateSource.candidates``: serving,
not ejected, not draining, of that model); this module adds the request's own limits —
replicas already tried, a deadline its predicted queue wait would miss — and the bounded-load
cap (ε) the affinity and prefix policies apply before scoring. Pure: no grpc, no asyncio.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from services.router.placement.candidate import Candidate
from services.router.placement.ring import bounded_capacity


class Placeable(Candidate, Protocol):
    """A candidate that can say how long a new request would wait on it."""

    def predicted_wait_s(self) -> float: ...


P = TypeVar("P", bound=Placeable)
P_co = TypeVar("P_co", bound=Placeable, covariant=True)
T = TypeVar("T", bound=Candidate)


class CandidateSource(Protocol[P_co]):
    """The eligible replicas of a model (``ReplicaPool.candidates``: serving, not ejected, not draining)."""

    def candidates(self, model: str) -> Sequence[P_co]: ...


def of_model(source: CandidateSource[P], model: str, exclude: frozenset[str]) -> list[P]:
    """The model's healthy replicas (the pool's filter), less those this generation tried."""
    return [r for r in source.candidates(model) if r.address not in exclude]


@dataclass(frozen=True)
class DeadlineSplit(Generic[P]):
    """The candidates whose predicted wait fits the time left, and the least wait of those that do not."""

    fits: list[P]
    least_wait_s: float


def within_deadline(candidates: Sequence[P], remaining_s: float) -> DeadlineSplit[P]:
    """Those that would start a new request before the deadline (``predicted_wait_s < remaining_s``)."""
    fits = [r for r in candidates if r.predicted_wait_s() < remaining_s]
    least = min((r.predicted_wait_s() for r in candidates), default=0.0) if not fits else 0.0
    return DeadlineSplit(fits, least)


def in_flight(c: Candidate) -> int:
    """This router's generations open on the replica: the affinity bound's load."""
    return c.in_flight


@dataclass(frozen=True)
class LoadBound:
    """Consistent hashing with bounded loads' cap (Mirrokni et al.): no replica takes more than
    ⌈(1 + ε) · average⌉, counting the request being placed, so a popular key (a session, a
    hot prefix) spills onto other replicas instead of burying one."""

    epsilon: float
    load: Callable[[Candidate], int] = in_flight
    #: No replica is over the bound below this load: near idle, ⌈(1 + ε) · average⌉ is 1 or 2,
    #: and a replica that just took one request (or still reports it) would lose the next of
    #: its prefix or session for no gain.
    floor: int = 0

    def __post_init__(self) -> None:
        if self.epsilon < 0 or not math.isfinite(self.epsilon):
            raise ValueError("epsilon must be a finite number >= 0")

    def capacity(self, candidates: Sequence[Candidate]) -> int:
        cap = bounded_capacity(sum(self.load(c) for c in candidates), len(candidates), self.epsilon)
        return max(cap, self.floor)

    def admits(self, chosen: Candidate, candidates: Sequence[Candidate]) -> bool:
        """Whether ``chosen`` (one of ``candidates``) may take one more under the cap."""
        return self.load(chosen) < self.capacity(candidates)

    def within(self, candidates: Sequence[T]) -> list[T]:
        """The candidates under the cap (never all of them over it: the cap exceeds the average)."""
        cap = self.capacity(candidates)
        return [c for c in candidates if self.load(c) < cap]
