"""Per-request timings of one benchmark run, and the summary figures derived from them."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    """When one request arrived, got its first token and finished (seconds on one clock)."""

    request_id: str
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    token_ids: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        if self.first_token is None:
            raise ValueError(f"request {self.request_id} never produced a token")
        return self.first_token - self.arrival

    @property
    def latency(self) -> float:
        if self.finish is None:
            raise ValueError(f"request {self.request_id} never finished")
        return self.finish - self.arrival


@dataclass
class MethodRun:
    """Everything one method produced in one round: timings per request plus notes."""

    method: str
    timings: dict[str, RequestTiming]
    # Printed under the table, e.g. "timed 8 of 64 requests, tok/s extrapolated".
    note: str = ""
    # Requests that were not run but simulated (naive may time a subset): their token ids
    # are placeholders, so they count towards tok/s but never towards token equality.
    simulated: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Summary:
    """The figures the JSON and the table report for one method."""

    tok_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    latency_p50_s: float
    latency_p95_s: float

    def as_dict(self) -> dict[str, float]:
        return {
            "tok_s": round(self.tok_s, 2),
            "ttft_p50_s": round(self.ttft_p50_s, 4),
            "ttft_p95_s": round(self.ttft_p95_s, 4),
            "latency_p50_s": round(self.latency_p50_s, 4),
            "latency_p95_s": round(self.latency_p95_s, 4),
        }


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]), the numpy default, without numpy."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(run: MethodRun) -> Summary:
    """Throughput over the makespan (first arrival to last finish) and TTFT/latency percentiles."""
    timings = list(run.timings.values())
    if not timings:
        raise ValueError(f"{run.method}: no requests were timed")
    tokens = sum(len(t.token_ids) for t in timings)
    start = min(t.arrival for t in timings)
    end = max(t.latency + t.arrival for t in timings)
    ttfts = [t.ttft for t in timings]
    latencies = [t.latency for t in timings]
    return Summary(
        tok_s=tokens / (end - start) if end > start else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        latency_p50_s=percentile(latencies, 50),
        latency_p95_s=percentile(latencies, 95),
    )


def median_summary(summaries: list[Summary]) -> Summary:
    """Field-wise median over rounds: the machine drifts, so single rounds mislead."""
    return Summary(
        tok_s=statistics.median(s.tok_s for s in summaries),
        ttft_p50_s=statistics.median(s.ttft_p50_s for s in summaries),
        ttft_p95_s=statistics.median(s.ttft_p95_s for s in summaries),
        latency_p50_s=statistics.median(s.latency_p50_s for s in summaries),
        latency_p95_s=statistics.median(s.latency_p95_s for s in summaries),
    )
