"""Replica choice for one attempt: eligible candidates, the deadline filter, the session pin, the policy.

Pure: no grpc, asyncio or Redis. The clock is injected, so tests control how
much time is left before a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from services.common import errors
from services.router.placement.policies import BalancingPolicy, Candidate


class Placeable(Candidate, Protocol):
    """A candidate that can say how long a new request would wait on it."""

    def predicted_wait_s(self) -> float: ...


R = TypeVar("R", bound=Placeable)
R_co = TypeVar("R_co", bound=Placeable, covariant=True)


class CandidateSource(Protocol[R_co]):
    """The eligible replicas of a model (``ReplicaPool.candidates``: serving, not ejected, not draining)."""

    def candidates(self, model: str) -> Sequence[R_co]: ...


class ReplicaPicker(Generic[R]):
    """Picks the replica (and its model) for the next attempt of a generation."""

    def __init__(
        self, pool: CandidateSource[R], policy: BalancingPolicy, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.pool = pool
        self.policy = policy
        self._clock = clock

    def pick(
        self,
        models: Sequence[str],
        session_key: str | None,
        exclude: set[str],
        deadline: float | None,
        preferred: str | None = None,
    ) -> tuple[R, str] | None:
        """The replica for the next attempt and its model, or None when no model has one.

        Models are tried in order (the plan's fallbacks). Of a model's candidates, those in
        ``exclude`` (tried already) and those whose predicted wait misses ``deadline`` are
        left out; the ``preferred`` (pinned) replica wins if the policy accepts the pin,
        otherwise the policy chooses. Nothing picked while some model's every candidate would
        wait past the deadline is DeadlineExceeded, not None.
        """
        too_slow = 0.0
        for model in models:
            candidates = [r for r in self.pool.candidates(model) if r.address not in exclude]
            if deadline is not None and candidates:
                remaining = deadline - self._clock()
                fits = [r for r in candidates if r.predicted_wait_s() < remaining]
                if not fits:
                    too_slow = min(r.predicted_wait_s() for r in candidates)
                    continue
                candidates = fits
            if not candidates:
                continue
            if preferred is not None:
                for r in candidates:
                    # A pinned replica keeps its session unless the policy refuses it (over the
                    # affinity policy's bounded-load cap).
                    if r.address == preferred and self.policy.accepts_pin(r, candidates):
                        return r, model
            chosen = self.policy.choose(candidates, session_key)
            if chosen is not None:
                return chosen, model
        if too_slow:
            raise errors.DeadlineExceeded(
                f"predicted queue wait {too_slow:.2f} s exceeds the time left before the deadline"
            )
        return None
