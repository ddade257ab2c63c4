"""Semantic-cache safety: false hits by kind and paraphrase hits, old behaviour against new, one run.

    python -m bench.semantic_cache                       # bench/data/semantic_cache_pairs.jsonl
    llm-mesh bench semantic-cache --json bench/results/semantic-cache.json --show

Each labelled pair is (a cached question, a new question, same meaning or not, the
kind of difference). Both questions are embedded with the retriever's model (the
packaged all-MiniLM-L6-v2); a pair *hits* when the cache would serve the cached
answer to the new question:

- **old**: cosine ≥ 0.92 on the last message alone (seed 000's semantic cache);
- **new**: the same tenant-scoped match at ``--candidate-threshold``, scoped to the
  asker for a personal question (``semantic_scope.is_personal``), then every check
  of ``semantic_verify`` (``new-cheap``: all but the alignment judgment, to show
  what it buys).

A hit on a different-meaning pair is a false hit; on a same-meaning pair, a served
paraphrase. ``verify_p50_ms``/``verify_p95_ms`` are what the router adds per
lookup (scope check + verifier), timed over every pair.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bench.timings import percentile
from services.retriever.embedder import DEFAULT_EMBEDDING_MODEL, Embedder
from services.router.turns.semantic_scope import is_personal
from services.router.turns.semantic_verify import DEFAULT_CANDIDATE_THRESHOLD, REASONS, refusal

DATA = Path(__file__).parent / "data"
# The set the checks were written against, one written after them, and the look-alikes an
# audit found served (2026-12-07), against which the asks/modal/particle/choice checks were
# written; then the look-alikes a second audit found served (tense, to/from, swapped
# neighbours, "only", a minus sign, near names, "how"/"when"), which the tense/only checks
# and the stricter typo rule were written against, and more of each kind written before
# those checks were run on them (see docs/benchmarks.md).
PAIRS = (
    DATA / "semantic_cache_pairs.jsonl",
    DATA / "semantic_cache_pairs_heldout.jsonl",
    DATA / "semantic_cache_pairs_audit.jsonl",
    DATA / "semantic_cache_pairs_lookalikes.jsonl",
    DATA / "semantic_cache_pairs_lookalikes_heldout.jsonl",
)
OLD_THRESHOLD = 0.92
# The candidate threshold the router asks the retriever for (before verification).
NEW_THRESHOLD = DEFAULT_CANDIDATE_THRESHOLD


@dataclass(frozen=True)
class Pair:
    cached: str
    query: str
    same: bool
    kind: str
    cached_user: str = ""
    query_user: str = ""


def load_pairs(path: Path) -> list[Pair]:
    pairs = []
    for line in path.read_text().splitlines():
        if line.strip():
            pairs.append(Pair(**json.loads(line)))
    return pairs


def new_decision(pair: Pair, similarity: float, threshold: float, checks: tuple[str, ...]) -> str | None:
    """None when the new cache serves the pair; else why not ("similarity", "user" or a check's name)."""
    if is_personal(pair.query) and pair.cached_user != pair.query_user:
        return "user"  # a personal question is scoped to its asker: another user's entry is never seen
    if similarity < threshold:
        return "similarity"
    return refusal(pair.query, pair.cached, checks)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pairs", type=Path, nargs="+", default=list(PAIRS), help="labelled pair files (JSON lines)"
    )
    parser.add_argument("--candidate-threshold", type=float, default=NEW_THRESHOLD)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--show", action="store_true", help="print every pair the new cache gets wrong")


def run(args: argparse.Namespace) -> int:
    embedder = Embedder(DEFAULT_EMBEDDING_MODEL)
    reports = {}
    for path in args.pairs:
        reports[path.name] = _run_set(args, embedder, load_pairs(path), path.name)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2) + "\n")
    return 0


def _run_set(args: argparse.Namespace, embedder: Embedder, pairs: list[Pair], name: str) -> dict[str, object]:
    cached = embedder.embed([p.cached for p in pairs])
    queries = embedder.embed([p.query for p in pairs])
    similarities = np.sum(cached * queries, axis=1)
    cheap = tuple(r for r in REASONS if r != "alignment")
    variants = {
        "old": lambda p, s: None if s >= OLD_THRESHOLD else "similarity",
        "new-cheap": lambda p, s: new_decision(p, s, args.candidate_threshold, cheap),
        "new": lambda p, s: new_decision(p, s, args.candidate_threshold, REASONS),
    }
    report: dict[str, object] = {
        "set": name,
        "pairs": len(pairs),
        "candidate_threshold": args.candidate_threshold,
    }
    for name, decide in variants.items():
        report[name] = _score(pairs, [decide(p, float(s)) for p, s in zip(pairs, similarities, strict=True)])
    timings = []
    for _ in range(20):
        for pair, similarity in zip(pairs, similarities, strict=True):
            started = time.perf_counter()
            new_decision(pair, float(similarity) + 1.0, args.candidate_threshold, REASONS)
            timings.append((time.perf_counter() - started) * 1000)
    report["verify_p50_ms"] = round(percentile(timings, 50), 4)
    report["verify_p95_ms"] = round(percentile(timings, 95), 4)
    report["machine"] = platform.processor() or platform.machine()
    report["date"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    report["commit"] = _commit()
    _print(report)
    if args.show:
        for pair, similarity in zip(pairs, similarities, strict=True):
            served = variants["new"](pair, float(similarity)) is None
            if served != pair.same:
                print(f"  {'FALSE HIT' if served else 'miss'} {pair.kind} {similarity:.3f}: ", end="")
                print(f"{pair.cached!r} / {pair.query!r} -> {variants['new'](pair, float(similarity))}")
    return report


def _score(pairs: list[Pair], decisions: list[str | None]) -> dict[str, object]:
    by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    reasons: dict[str, int] = defaultdict(int)
    for pair, decision in zip(pairs, decisions, strict=True):
        kind = "paraphrase" if pair.same else pair.kind
        by_kind[kind][0] += 1
        by_kind[kind][1] += decision is None
        if decision is not None and not pair.same:
            reasons[decision] += 1
    different = [(k, n, h) for k, (n, h) in by_kind.items() if k != "paraphrase"]
    false_hits = sum(h for _, _, h in different)
    total_different = sum(n for _, n, _ in different)
    paraphrases, served = by_kind["paraphrase"]
    return {
        "false_hit_rate": round(false_hits / total_different, 4),
        "false_hits": false_hits,
        "different_pairs": total_different,
        "paraphrase_hit_rate": round(served / paraphrases, 4),
        "paraphrase_pairs": paraphrases,
        "false_hit_rate_by_kind": {k: round(h / n, 4) for k, n, h in sorted(different)},
        "refusals_by_reason": dict(sorted(reasons.items())),
    }


def _print(report: dict[str, object]) -> None:
    print(
        f"semantic cache, {report['set']}: {report['pairs']} labelled pairs, "
        f"candidate threshold {report['candidate_threshold']}"
    )
    for name in ("old", "new-cheap", "new"):
        figures = report[name]
        assert isinstance(figures, dict)
        print(
            f"  {name:10s} false hits {figures['false_hit_rate']:.1%} ({figures['false_hits']}/"
            f"{figures['different_pairs']}), paraphrase hits {figures['paraphrase_hit_rate']:.1%}"
        )
        kinds = ", ".join(f"{k} {v:.0%}" for k, v in figures["false_hit_rate_by_kind"].items())
        print(f"             by kind: {kinds}")
    print(f"  added per lookup: p50 {report['verify_p50_ms']} ms, p95 {report['verify_p95_ms']} ms")


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


if __name__ == "__main__":
    main_parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(main_parser)
    raise SystemExit(run(main_parser.parse_args()))
