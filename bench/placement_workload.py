"""The placement benchmark's workload and summary: prefix groups, Poisson arrivals, per-policy figures.

A group is one long common prefix (a system prompt or a retrieved RAG context, 500–2,000
tokens) shared by every request of the group; each request adds its own short question.
Groups are drawn with a skew (a few popular ones, a long tail), so more groups are live
than one replica's KV cache holds and a policy that ignores the cache prefills them again.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from bench.timings import percentile

# Words a prefix is drawn from: ~1 token each with SmolLM2's tokenizer, so words ≈ tokens.
WORDS = [
    "policy",
    "order",
    "refund",
    "shipping",
    "account",
    "invoice",
    "customer",
    "support",
    "warranty",
    "delivery",
    "store",
    "product",
    "return",
    "exchange",
    "payment",
    "card",
    "address",
    "email",
    "phone",
    "manager",
    "ticket",
    "issue",
    "answer",
    "question",
    "review",
    "rating",
    "discount",
    "coupon",
    "member",
    "service",
    "hours",
    "window",
    "branch",
    "region",
]
QUESTIONS = (
    "Can I return an opened item?",
    "How long does delivery take?",
    "Who do I call about my invoice?",
    "Is there a discount for members?",
    "What are the support hours?",
    "Can I change my address after ordering?",
)


@dataclass(frozen=True)
class PlacementRequest:
    """One request of the workload: when to send it, its group and its prompt."""

    at_s: float
    group: int
    system: str
    question: str


def prefixes(groups: int, tokens: int, seed: int) -> list[str]:
    """One distinct prefix of about ``tokens`` words per group (the group number leads, so no
    two groups share even their first block)."""
    rng = random.Random(seed)
    return [f"Context {g}: " + " ".join(rng.choice(WORDS) for _ in range(tokens)) for g in range(groups)]


def workload(
    num_requests: int, groups: int, prefix_tokens: int, rate: float, seed: int, skew: float = 1.0
) -> list[PlacementRequest]:
    """Poisson arrivals at ``rate``/s; the group of each request drawn with Zipf weights 1/(g+1)^skew."""
    rng = random.Random(seed)
    texts = prefixes(groups, prefix_tokens, seed)
    weights = [1.0 / (g + 1) ** skew for g in range(groups)]
    at = 0.0
    out: list[PlacementRequest] = []
    for i in range(num_requests):
        g = rng.choices(range(groups), weights)[0]
        out.append(PlacementRequest(at, g, texts[g], f"[{i}] {QUESTIONS[i % len(QUESTIONS)]}"))
        at += rng.expovariate(rate)
    return out


@dataclass
class Result:
    """What one request measured: its timings, where it ran, how much of its prompt was cached."""

    ok: bool
    started_s: float = 0.0
    ended_s: float = 0.0
    ttft_s: float = 0.0
    replica: str = ""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


def bound(in_flight_total: int, replicas: int, epsilon: float, floor: int) -> int:
    """The prefix policy's load bound, ⌈(1 + ε) · average⌉ counting the request placed, at least ``floor``."""
    return max(floor, math.ceil((1 + epsilon) * (in_flight_total + 1) / replicas))


def load_at_placement(
    results: Sequence[Result], replicas: int, epsilon: float, floor: int
) -> tuple[int, int]:
    """The most requests any replica had in flight when one was placed on it, and how many
    placements went over the bound (loads as the client saw them: sent and not yet answered)."""
    done = [r for r in results if r.ok]
    worst = over = 0
    for r in done:
        running = [o for o in done if o is not r and o.started_s <= r.started_s < o.ended_s]
        here = sum(o.replica == r.replica for o in running)
        worst = max(worst, here + 1)
        over += here + 1 > bound(len(running), replicas, epsilon, floor)
    return worst, over


def summarize(
    results: Sequence[Result], replicas: Sequence[str], epsilon: float, floor: int
) -> dict[str, object]:
    """TTFT percentiles (ms), throughput over the run's span, per-replica share, load vs the bound."""
    done = [r for r in results if r.ok]
    ttft = [r.ttft_s * 1000 for r in done]
    span = max((r.ended_s for r in done), default=0.0) - min((r.started_s for r in done), default=0.0)
    share = Counter(r.replica for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    worst, over = load_at_placement(results, len(replicas), epsilon, floor)
    row: dict[str, object] = {
        "requests": len(results),
        "failed": len(results) - len(done),
        "ttft_ms_p50": round(percentile(ttft, 50), 1) if ttft else 0.0,
        "ttft_ms_p90": round(percentile(ttft, 90), 1) if ttft else 0.0,
        "requests_per_s": round(len(done) / span, 3) if span > 0 else 0.0,
        "prompt_tokens": prompt,
        "cached_prompt_share": round(sum(r.cached_prompt_tokens for r in done) / prompt, 3)
        if prompt
        else 0.0,
        "replica_share": {a: round(share[a] / len(done), 3) if done else 0.0 for a in replicas},
        "max_in_flight_per_replica": worst,
        "placements_over_bound": over,
    }
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        row["errors"] = "; ".join(errors[:3])
    return row


def ratios(prefix: dict[str, object], wrt: dict[str, object]) -> dict[str, float]:
    """The issue's goals, prefix-aware against weighted response time: TTFT p90 ≤ 0.5, throughput ≥ 1.3."""

    def div(a: object, b: object) -> float:
        x, y = float(a), float(b)  # type: ignore[arg-type]
        return round(x / y, 3) if y else 0.0

    return {
        "ttft_p90_prefix_over_wrt": div(prefix["ttft_ms_p90"], wrt["ttft_ms_p90"]),
        "throughput_prefix_over_wrt": div(prefix["requests_per_s"], wrt["requests_per_s"]),
    }
