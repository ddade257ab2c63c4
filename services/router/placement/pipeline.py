"""One placement pipeline: bounded-load filter → weighted scorers → selector.

Every balancing policy is a configuration of ``Pipeline`` (policies.py): which scorers with
which weights, which selector, whether a load bound (ε) applies. ``SessionFirst`` chains two:
a session's key goes to the session pipeline (the affinity ring), anything else — or a
session whose ring replicas are all over the bound — to the fallback. The pool's model and
health filter and the request's own (exclude, deadline) run before, in picker.py.

Pure: no grpc, no asyncio; randomness lives in the selectors, injected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol

from services.router.placement.candidate import C, Candidate
from services.router.placement.filters import LoadBound
from services.router.placement.request import PlacementRequest
from services.router.placement.scorers import Scorer
from services.router.placement.selectors import Selector

#: Why a replica was chosen, the label of ``llmmesh_router_placements_total{reason}``: ``pin``
#: the session's pinned replica kept; ``ring`` the session's place on the affinity ring;
#: ``prefix`` the prefix policy's least work on a replica holding part of the prompt;
#: ``load`` a load-only choice (wrt, least, p2c, round robin, a prefix choice with no cached
#: prefix anywhere); ``fallback`` the policy's own rule could not decide (a session whose ring
#: replicas are all over the bound, every replica over the bound, a later model of the plan).
Reason = Literal["pin", "ring", "prefix", "load", "fallback"]


@dataclass(frozen=True)
class Decision(Generic[C]):
    """A policy's choice, why, and how many of the prompt's tokens the index says it holds."""

    chosen: C | None
    reason: Reason = "load"
    #: Leading prompt tokens the chosen replica holds per the prefix index (0 without one).
    cached_prefix_tokens: int = 0


class BalancingPolicy(Protocol):
    """Picks a replica for a request from the eligible ones; the picker's only view of a policy."""

    name: str

    def select(self, candidates: Sequence[C], request: PlacementRequest) -> C | None: ...

    def decide(self, candidates: Sequence[C], request: PlacementRequest) -> Decision[C]:
        """``select`` with the reason for the choice, for the placement metrics."""
        ...

    def accepts_pin(self, pinned: Candidate, candidates: Sequence[Candidate]) -> bool:
        """Whether a session pinned to ``pinned`` (one of ``candidates``) may stay there."""
        ...

    def placed(self, chosen: Candidate, request: PlacementRequest) -> None:
        """``request`` is being sent to ``chosen``: a policy that learns from its own choices notes it."""
        ...

    def withdrawn(self, chosen: Candidate, request: PlacementRequest) -> None:
        """``request`` ended on ``chosen`` before its first token (refused, failed, cancelled while
        queued): what ``placed`` noted of it is taken back."""
        ...

    def prefilled(self, chosen: Candidate, request: PlacementRequest) -> None:
        """``request`` got its first token on ``chosen``: its prompt is prefilled there, so what
        ``placed`` noted as on its way is not any more."""
        ...

    def choose(self, candidates: Sequence[C], session_key: str | None = None) -> C | None:
        """``select`` for a request known only by its session key."""
        ...


class Policy:
    """What every configuration shares: ``choose`` by session key alone, no learning by default."""

    name = ""

    def select(self, candidates: Sequence[C], request: PlacementRequest) -> C | None:
        return self.decide(candidates, request).chosen

    def decide(self, candidates: Sequence[C], request: PlacementRequest) -> Decision[C]:
        raise NotImplementedError

    def choose(self, candidates: Sequence[C], session_key: str | None = None) -> C | None:
        return self.select(candidates, PlacementRequest((), session_key=session_key))

    def accepts_pin(self, pinned: Candidate, candidates: Sequence[Candidate]) -> bool:
        return True

    def placed(self, chosen: Candidate, request: PlacementRequest) -> None:
        return None

    def withdrawn(self, chosen: Candidate, request: PlacementRequest) -> None:
        return None

    def prefilled(self, chosen: Candidate, request: PlacementRequest) -> None:
        return None


@dataclass(frozen=True)
class Weighted:
    """A scorer and its weight in the summed cost."""

    scorer: Scorer
    weight: float = 1.0


class Pipeline(Policy):
    """Bounded loads, then the weighted sum of the scorers' costs, then the selector.

    With a ``bound``, candidates at or over ⌈(1 + ε) · average load⌉ are left out before the
    selector sees them (scorers still see every candidate: their relative costs, such as the
    mean latency, are of the whole set). ``strict``: when all are over (possible only with a
    bound on another load than the one chosen), choose nothing and let a fallback decide.
    """

    def __init__(
        self,
        name: str,
        scorers: Sequence[Weighted],
        selector: Selector,
        bound: LoadBound | None = None,
        strict: bool = False,
        on_placed: Callable[[Candidate, PlacementRequest], None] | None = None,
    ) -> None:
        if not scorers:
            raise ValueError("a pipeline needs at least one scorer")
        self.name = name
        self.scorers = list(scorers)
        self.selector = selector
        self.bound = bound
        self.strict = strict
        self._on_placed = on_placed

    def costs(self, candidates: Sequence[Candidate], request: PlacementRequest) -> list[float]:
        """The weighted sum of every scorer's cost, per candidate."""
        first, *rest = self.scorers
        total = [first.weight * s for s in first.scorer.score(candidates, request)]
        for weighted in rest:
            for i, s in enumerate(weighted.scorer.score(candidates, request)):
                total[i] += weighted.weight * s
        return total

    def decide(self, candidates: Sequence[C], request: PlacementRequest) -> Decision[C]:
        if not candidates:
            return Decision(None)
        costs = self.costs(candidates, request)
        if self.bound is None:
            return self.explain(self.selector.select(candidates, costs, request), request)
        cap = self.bound.capacity(candidates)
        kept = [i for i, c in enumerate(candidates) if self.bound.load(c) < cap]
        if not kept:
            if self.strict:
                return Decision(None)
            everyone = self.selector.select(candidates, costs, request)
            return Decision(everyone, "fallback", self.explain(everyone, request).cached_prefix_tokens)
        chosen = self.selector.select([candidates[i] for i in kept], [costs[i] for i in kept], request)
        return self.explain(chosen, request)

    def explain(self, chosen: C | None, request: PlacementRequest) -> Decision[C]:
        """Why this configuration chose ``chosen`` within its bound: by load, unless it says otherwise."""
        return Decision(chosen)

    def accepts_pin(self, pinned: Candidate, candidates: Sequence[Candidate]) -> bool:
        """A pin holds while its replica is within the bounded load, as the pipeline's own choice does."""
        return self.bound is None or self.bound.admits(pinned, candidates)

    def placed(self, chosen: Candidate, request: PlacementRequest) -> None:
        if self._on_placed is not None:
            self._on_placed(chosen, request)


class SessionFirst(Policy):
    """A session's turn goes where ``session`` puts it; other requests, and a session that
    pipeline declines (every ring replica over the bound), go where ``fallback`` puts them."""

    def __init__(self, name: str, session: Pipeline, fallback: BalancingPolicy) -> None:
        self.name = name
        self.session = session
        self.fallback = fallback

    def decide(self, candidates: Sequence[C], request: PlacementRequest) -> Decision[C]:
        if request.session_key and candidates:
            chosen = self.session.select(candidates, request)
            if chosen is not None:
                return Decision(chosen, "ring")
            declined = self.fallback.decide(candidates, request)
            return Decision(declined.chosen, "fallback", declined.cached_prefix_tokens)
        return self.fallback.decide(candidates, request)

    def accepts_pin(self, pinned: Candidate, candidates: Sequence[Candidate]) -> bool:
        return self.session.accepts_pin(pinned, candidates)

    def placed(self, chosen: Candidate, request: PlacementRequest) -> None:
        self.fallback.placed(chosen, request)

    def withdrawn(self, chosen: Candidate, request: PlacementRequest) -> None:
        self.fallback.withdrawn(chosen, request)

    def prefilled(self, chosen: Candidate, request: PlacementRequest) -> None:
        self.fallback.prefilled(chosen, request)
