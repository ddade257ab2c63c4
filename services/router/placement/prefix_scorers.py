"""Scorers for prefix-cache-aware placement: predicted work in seconds, Dynamo's form.

predicted work on a replica = uncached prefill tokens × its prefill cost per token
                            + (running + waiting) × its decode cost per request
                            + other prompts' prefill queued there × its prefill cost per token

The last term is Dynamo's "active prefill tokens": a request queued behind another group's cold
prefill waits seconds, not one decode's worth, so counting every request ahead as a decode sent
new prefixes to replicas busy prefilling (bench/placement.py, 06:17 run).

Both costs are learned from the replica's own reported timings (``ReplicaCosts``); a replica
without samples counts as the mean of those with, and with none at all the defaults hold.
The load is the larger of what this router has open on the replica (``in_flight``: counted
the moment a request is placed, so the next placement of a burst sees it) and what the
replica last reported (GetLoad, polled: it lags a burst by up to a poll interval, but it
includes other routers' work). With nothing in flight every router that polls the same
replicas and holds the same index computes the same costs. Pure: no grpc, no asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.router.placement.candidate import Candidate
from services.router.placement.prefix_index import PrefixIndex
from services.router.placement.request import PlacementRequest


@dataclass(frozen=True)
class CostDefaults:
    """Costs assumed before any replica has reported timings."""

    #: About a small model's prefill rate on one GPU (~5k tokens/s).
    prefill_s_per_token: float = 2e-4
    #: A typical short answer's decode time.
    decode_s_per_request: float = 0.2


def learned_or_mean(values: Sequence[float | None], default: float) -> list[float]:
    """Each value, or where unknown the mean of the known ones (the default when none is known)."""
    known = [v for v in values if v is not None]
    mean = sum(known) / len(known) if known else default
    return [mean if v is None else v for v in values]


class PrefixOverlap:
    """Prompt tokens each replica would have to prefill: the prompt less its longest cached prefix
    (from the index: the replica's KV events, else what this router sent it)."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def uncached_tokens(self, candidates: Sequence[Candidate], request: PlacementRequest) -> list[int]:
        total = request.prompt_tokens
        hashes, block_size = request.prefix_hashes, request.block_size
        if not hashes:
            return [total] * len(candidates)
        cached = self.index.cached_prefix_blocks
        return [total - cached(c.address, hashes, block_size) * block_size for c in candidates]

    def score(self, candidates: Sequence[Candidate], request: PlacementRequest) -> list[float]:
        return [float(n) for n in self.uncached_tokens(candidates, request)]


class PrefillWork:
    """Seconds of prefill a replica would spend: uncached tokens × its learned prefill cost per token."""

    def __init__(self, overlap: PrefixOverlap, defaults: CostDefaults | None = None) -> None:
        self.overlap = overlap
        self.defaults = defaults or CostDefaults()

    def score(self, candidates: Sequence[Candidate], request: PlacementRequest) -> list[float]:
        uncached = self.overlap.uncached_tokens(candidates, request)
        per_token = learned_or_mean(
            [c.prefill_s_per_token for c in candidates], self.defaults.prefill_s_per_token
        )
        return [n * cost for n, cost in zip(uncached, per_token, strict=True)]


def reported_load(c: Candidate) -> int:
    """Running plus waiting as the replica reported them (alike on every router that polls it)."""
    return c.reported_load


def placement_load(c: Candidate) -> int:
    """The prefix policy's load: this router's own open generations there, seen at once, or the
    replica's report (which also holds other routers' work), whichever is more.

    The report alone let a burst inside one poll interval land on the replica that looked idle
    (9 in flight on one replica in the 03:40 benchmark); the sum would count this router's own
    requests twice once the report catches up.
    """
    return max(c.in_flight, c.reported_load)


class QueuedWork:
    """Seconds of work already on a replica: its load × its learned decode cost per request."""

    def __init__(
        self, defaults: CostDefaults | None = None, load: Callable[[Candidate], int] = placement_load
    ) -> None:
        self.defaults = defaults or CostDefaults()
        self.load = load

    def score(self, candidates: Sequence[Candidate], request: PlacementRequest) -> list[float]:
        per_request = learned_or_mean(
            [c.decode_s_per_request for c in candidates], self.defaults.decode_s_per_request
        )
        return [self.load(c) * cost for c, cost in zip(candidates, per_request, strict=True)]


class QueuedPrefill:
    """Seconds of other prompts' prefill queued on a replica: the blocks this router sent there
    that its KV events have not stored yet, outside this request's own chain
    (``PrefixIndex.pending_tokens_outside``), × the replica's learned prefill cost per token."""

    def __init__(self, index: PrefixIndex, defaults: CostDefaults | None = None) -> None:
        self.index = index
        self.defaults = defaults or CostDefaults()

    def score(self, candidates: Sequence[Candidate], request: PlacementRequest) -> list[float]:
        per_token = learned_or_mean(
            [c.prefill_s_per_token for c in candidates], self.defaults.prefill_s_per_token
        )
        pending = self.index.pending_tokens_outside
        hashes = request.prefix_hashes
        return [pending(c.address, hashes) * cost for c, cost in zip(candidates, per_token, strict=True)]
