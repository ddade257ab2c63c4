"""Replica choice for one attempt: the filters, the session pin, then the policy's pipeline.

filters (the pool's model and health, the request's exclude and deadline) → the pin, if the
policy accepts it → the policy (scorers → selector, pipeline.py). Pure: no grpc, asyncio or
Redis. The clock is injected, so tests control how much time is left before a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from services.common import errors
from services.router.placement import filters
from services.router.placement.filters import CandidateSource, Placeable
from services.router.placement.pipeline import BalancingPolicy, Decision
from services.router.placement.request import PlacementRequest

R = TypeVar("R", bound=Placeable)

__all__ = ["CandidateSource", "Placeable", "ReplicaPicker"]


class ReplicaPicker(Generic[R]):
    """Picks the replica (and its model) for the next attempt of a generation."""

    def __init__(
        self,
        pool: CandidateSource[R],
        policy: BalancingPolicy,
        clock: Callable[[], float] = time.monotonic,
        on_decision: Callable[[Decision[R], PlacementRequest], None] | None = None,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self._clock = clock
        #: Told every placement and why (the router's metrics); injected, so this stays pure.
        self._on_decision = on_decision

    def place(self, request: PlacementRequest) -> tuple[R, str] | None:
        """The replica for the next attempt and its model, or None when no model has one.

        Models are tried in order (the plan's fallbacks). Of a model's candidates, those in
        ``request.exclude`` (tried already) and those whose predicted wait misses its deadline
        are left out; the pinned replica wins if the policy accepts the pin, otherwise the
        policy chooses. Nothing picked while some model's every candidate would wait past the
        deadline is DeadlineExceeded, not None. The policy is told where the request goes.
        """
        too_slow = 0.0
        for rank, model in enumerate(request.models):
            candidates = filters.of_model(self.pool, model, request.exclude)
            if request.deadline is not None and candidates:
                split = filters.within_deadline(candidates, request.deadline - self._clock())
                if not split.fits:
                    too_slow = split.least_wait_s
                    continue
                candidates = split.fits
            if not candidates:
                continue
            pinned = self._pinned(candidates, request)
            decision = Decision(pinned, "pin") if pinned else self.policy.decide(candidates, request)
            chosen = decision.chosen
            if chosen is not None:
                if rank:  # the plan's first model had no replica: its fallback serves
                    decision = Decision(chosen, "fallback", decision.cached_prefix_tokens)
                self.policy.placed(chosen, request)
                if self._on_decision is not None:
                    self._on_decision(decision, request)
                return chosen, model
        if too_slow:
            raise errors.DeadlineExceeded(
                f"predicted queue wait {too_slow:.2f} s exceeds the time left before the deadline"
            )
        return None

    def withdraw(self, chosen: R, request: PlacementRequest) -> None:
        """The attempt ``place`` sent to ``chosen`` ended before its first token: the policy
        takes back what it noted of it."""
        self.policy.withdrawn(chosen, request)

    def prefilled(self, chosen: R, request: PlacementRequest) -> None:
        """The attempt ``place`` sent to ``chosen`` got its first token: its prompt is prefilled
        there, and the policy stops counting it as work on its way (the relay calls this once
        per attempt, as it calls ``withdraw`` for one that ended before its first token)."""
        self.policy.prefilled(chosen, request)

    def _pinned(self, candidates: Sequence[R], request: PlacementRequest) -> R | None:
        if request.pinned is None:
            return None
        for r in candidates:
            # A pinned replica keeps its session unless the policy refuses it (over a
            # bounded-load cap).
            if r.address == request.pinned and self.policy.accepts_pin(r, candidates):
                return r
        return None

    def pick(
        self,
        models: Sequence[str],
        session_key: str | None,
        exclude: set[str],
        deadline: float | None,
        preferred: str | None = None,
    ) -> tuple[R, str] | None:
        """``place`` for a request known only by its session and pin (pre-warm's moves)."""
        return self.place(PlacementRequest(models, session_key, preferred, frozenset(exclude), deadline))
