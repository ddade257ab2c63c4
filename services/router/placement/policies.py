"""The balancing policies, each a configuration of the one placement pipeline (pipeline.py).

=============  ========================================  ==================  ========================
policy         scorers (weight)                          bound (ε) on        selector
=============  ========================================  ==================  ========================
round_robin    rotation                                  –                   argmin
least          outstanding                               –                   argmin, random tie-break
p2c            outstanding                               –                   better of two random
wrt            expected response time                    –                   random ∝ 1 / cost
affinity/auto  session ring rank; wrt without a session  router in-flight    argmin
prefix         prefill work (w), queued work (w),        max(in-flight,      argmin, hash tie-break
               queued prefill (w)                        reported load)
=============  ========================================  ==================  ========================

Randomness is injected; no grpc or asyncio in here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from services.router.placement.candidate import C, Candidate, outstanding
from services.router.placement.ewma import LatencyEwma
from services.router.placement.filters import LoadBound
from services.router.placement.pipeline import (
    BalancingPolicy,
    Decision,
    Pipeline,
    SessionFirst,
    Weighted,
)
from services.router.placement.prefix_index import PrefixIndex
from services.router.placement.prefix_scorers import (
    CostDefaults,
    PrefillWork,
    PrefixOverlap,
    QueuedPrefill,
    QueuedWork,
    placement_load,
)
from services.router.placement.request import PlacementRequest
from services.router.placement.ring import DEFAULT_EPSILON
from services.router.placement.scorers import (
    Outstanding,
    ResponseTime,
    ResponseTimeModel,
    Rotation,
    SessionRing,
)
from services.router.placement.selectors import (
    ArgMin,
    HashTieBreak,
    RandomTieBreak,
    TwoChoices,
    WeightedRandom,
)

POLICY_NAMES = ("auto", "affinity", "wrt", "least", "p2c", "round_robin", "prefix")

# Re-exported: callers and tests name them from here.
__all__ = [
    "POLICY_NAMES",
    "AffinityPolicy",
    "BalancingPolicy",
    "Candidate",
    "LatencyEwma",
    "LeastOutstandingPolicy",
    "PowerOfTwoChoicesPolicy",
    "PrefixPolicy",
    "PrefixSettings",
    "ResponseTimeModel",
    "RoundRobinPolicy",
    "WeightedResponseTimePolicy",
    "make_policy",
    "outstanding",
]


class RoundRobinPolicy(Pipeline):
    """Each replica in turn."""

    def __init__(self) -> None:
        super().__init__("round_robin", [Weighted(Rotation())], ArgMin())


class LeastOutstandingPolicy(Pipeline):
    """The replica with the fewest outstanding requests; ties broken at random."""

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__("least", [Weighted(Outstanding())], ArgMin(RandomTieBreak(rng or random.Random())))


class PowerOfTwoChoicesPolicy(Pipeline):
    """Two replicas drawn at random; the less loaded one wins (Mitzenmacher)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__("p2c", [Weighted(Outstanding())], TwoChoices(rng or random.Random()))


class WeightedResponseTimePolicy(Pipeline):
    """Random pick weighted by 1 / expected response time.

    Expected time = (EWMA TTFT + EWMA inter-token latency × typical tokens) ×
    (1 + outstanding work), so a replica twice as slow, or with twice the
    queue, gets about half the share: slower replicas get proportionally less,
    but never nothing, which keeps their stats fresh.
    """

    def __init__(self, rng: random.Random | None = None, model: ResponseTimeModel | None = None) -> None:
        self.response_time = ResponseTime(model)
        super().__init__("wrt", [Weighted(self.response_time)], WeightedRandom(rng or random.Random()))

    @property
    def model(self) -> ResponseTimeModel:
        return self.response_time.model

    def expected_seconds(self, candidates: Sequence[Candidate]) -> list[float]:
        return self.response_time.score(candidates, PlacementRequest(()))


class AffinityPolicy(SessionFirst):
    """Consistent hashing on the session id with bounded loads; another policy without one.

    Composed, not copied: the load-based fallback is any other policy.
    """

    def __init__(
        self, fallback: BalancingPolicy, epsilon: float = DEFAULT_EPSILON, vnodes: int = 160
    ) -> None:
        if epsilon < 0 or not math.isfinite(epsilon):
            raise ValueError("epsilon must be a finite number >= 0")
        self.epsilon = epsilon
        ring = SessionRing(vnodes)
        self.ring = ring.ring
        # Strict: when every ring replica is full the fallback decides, as it always did.
        session = Pipeline("affinity", [Weighted(ring)], ArgMin(), bound=LoadBound(epsilon), strict=True)
        super().__init__("affinity", session, fallback)

    def within_bound(self, chosen: Candidate, candidates: Sequence[Candidate]) -> bool:
        """Whether ``chosen`` (e.g. a pinned replica) may take one more under the load cap."""
        return self.accepts_pin(chosen, candidates)


@dataclass(frozen=True)
class PrefixSettings:
    """The prefix policy's flags: the cost's weights, its load bound, the approximate index's expiry."""

    #: Weight of the uncached-prefill seconds in the cost (``--prefix-prefill-weight``).
    prefill_weight: float = 1.0
    #: Weight of the queued-and-running seconds, other prompts' queued prefill included (``--prefix-load-weight``).
    load_weight: float = 1.0
    #: Bounded-load slack on each replica's load, max(this router's in-flight, its report) (``--prefix-epsilon``).
    epsilon: float = 0.5
    #: Below this load a replica is never over the bound (``--prefix-bound-floor``).
    bound_floor: int = 4
    #: How long a prompt this router sent counts as cached where it went (``--prefix-approximate-ttl-s``).
    approximate_ttl_s: float = 120.0

    def __post_init__(self) -> None:
        for flag, value in (
            ("--prefix-prefill-weight", self.prefill_weight),
            ("--prefix-load-weight", self.load_weight),
        ):
            if value < 0 or not math.isfinite(value):
                raise ValueError(f"{flag} must be a finite number >= 0, got {value}")
        if self.epsilon < 0 or not math.isfinite(self.epsilon):
            raise ValueError(f"--prefix-epsilon must be a finite number >= 0, got {self.epsilon}")
        if self.bound_floor < 0:
            raise ValueError(f"--prefix-bound-floor must be >= 0, got {self.bound_floor}")
        if self.approximate_ttl_s <= 0:
            raise ValueError(f"--prefix-approximate-ttl-s must be > 0, got {self.approximate_ttl_s}")


class PrefixPolicy(Pipeline):
    """Least predicted work: uncached prefill seconds plus queued seconds, under a load bound.

    What it reads is alike on every router that polls the same replicas and consumes the same
    KV events (reported load, the index) once its own requests there have ended, and a tie
    goes by a hash of the request, so active-active routers place a request identically. Its
    own requests it counts at once (in-flight; the index's pending blocks until the replica's
    events store them, or the approximate mode for replicas that publish no events).
    """

    def __init__(
        self, index: PrefixIndex, settings: PrefixSettings | None = None, defaults: CostDefaults | None = None
    ) -> None:
        self.index = index
        self.settings = s = settings or PrefixSettings()
        overlap = PrefixOverlap(index)
        super().__init__(
            "prefix",
            [
                Weighted(PrefillWork(overlap, defaults), s.prefill_weight),
                Weighted(QueuedWork(defaults), s.load_weight),
                Weighted(QueuedPrefill(index, defaults), s.load_weight),
            ],
            ArgMin(HashTieBreak()),
            bound=LoadBound(s.epsilon, load=placement_load, floor=s.bound_floor),
        )

    def explain(self, chosen: C | None, request: PlacementRequest) -> Decision[C]:
        """``prefix`` when the chosen replica holds a leading part of the prompt, else ``load``."""
        if chosen is None or not request.prefix_hashes:
            return Decision(chosen)
        blocks = self.index.cached_prefix_blocks(chosen.address, request.prefix_hashes, request.block_size)
        cached = min(blocks * request.block_size, request.prompt_tokens)
        return Decision(chosen, "prefix" if cached else "load", cached)

    def placed(self, chosen: Candidate, request: PlacementRequest) -> None:
        self.index.record_sent(chosen.address, request.block_size, request.prefix_hashes)

    def withdrawn(self, chosen: Candidate, request: PlacementRequest) -> None:
        self.index.withdraw_sent(chosen.address, request.block_size, request.prefix_hashes)

    def prefilled(self, chosen: Candidate, request: PlacementRequest) -> None:
        self.index.prefilled(chosen.address, request.block_size, request.prefix_hashes)


def make_policy(
    name: str,
    rng: random.Random | None = None,
    epsilon: float = DEFAULT_EPSILON,
    prefix: PrefixSettings | None = None,
    index: PrefixIndex | None = None,
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
    if name == "prefix":
        settings = prefix or PrefixSettings()
        return PrefixPolicy(index or PrefixIndex(approximate_ttl_s=settings.approximate_ttl_s), settings)
    raise ValueError(f"--policy: unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
