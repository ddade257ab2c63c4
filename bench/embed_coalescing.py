"""Query embeds from concurrent requests: coalesced into shared model calls vs one call per text.

    python -m bench.embed_coalescing
    llm-mesh bench embed-coalescing --callers 1,6,12 --json bench/results/embed-coalescing.json

The retriever embeds every semantic-cache lookup's prompt and every search's query on
the executor thread serving that request. Here ``--callers`` threads (6 is what
asyncio's default executor gives the retriever on 2 CPUs) each embed distinct
questions through ``Embedder.embed`` (no memo hits), with the embedder as the service
builds it (``coalesced``: services/retriever/embed_batching.py) and with each text
encoded on its caller's thread (``per text``: the code before it). The two take turns
over ``--rounds`` in one process, on one kept pool of caller threads, and the printed figures are the medians of rounds:
texts per second, each text's wait (p50/p99, from its call to its vector) and the
coalesced calls' mean size.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from bench.retriever import machine_description
from bench.timings import percentile
from services.retriever.embed_batching import Vectors
from services.retriever.embedder import DEFAULT_EMBEDDING_MODEL, Embedder

_WORDS = [
    "pump",
    "pressure",
    "valve",
    "fault",
    "lease",
    "contract",
    "tenant",
    "court",
    "appeal",
    "invoice",
    "refund",
    "shipping",
    "orbit",
    "planet",
    "telescope",
    "galaxy",
    "recipe",
    "oven",
    "flour",
    "vaccine",
    "dose",
    "symptom",
    "router",
    "cache",
    "replica",
]


@dataclass
class Figures:
    mode: str
    callers: int
    texts_per_s: float
    wait_ms_p50: float
    wait_ms_p99: float
    mean_call_size: float


class PerText:
    """The code before coalescing: each caller encodes its own text on its own thread."""

    def __init__(self, embedder: Embedder) -> None:
        self._encode = embedder._encode
        self.calls = 0
        self.texts = 0

    def embed(self, text: str) -> Vectors:
        self.calls += 1
        self.texts += 1
        return self._encode([text])


def questions(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"{' '.join(rng.choice(_WORDS) for _ in range(rng.randint(6, 40)))} (#{seed}-{i})?"
        for i in range(count)
    ]


def measure(
    embedder: Embedder, mode: str, pool: ThreadPoolExecutor, callers: int, texts: list[str]
) -> Figures:
    coalescer = embedder._coalescer
    if mode == "per text":
        embedder._coalescer = PerText(embedder)  # type: ignore[assignment]
    calls_before, texts_before = embedder._coalescer.calls, embedder._coalescer.texts
    waits: list[float] = []

    def one(text: str) -> None:
        start = time.perf_counter()
        embedder.embed([text])
        waits.append(time.perf_counter() - start)

    try:
        start = time.perf_counter()
        list(pool.map(one, texts))
        elapsed = time.perf_counter() - start
        calls = embedder._coalescer.calls - calls_before
        encoded = embedder._coalescer.texts - texts_before
    finally:
        embedder._coalescer = coalescer
    return Figures(
        mode=mode,
        callers=callers,
        texts_per_s=round(len(texts) / elapsed, 1),
        wait_ms_p50=round(percentile(waits, 50) * 1e3, 2),
        wait_ms_p99=round(percentile(waits, 99) * 1e3, 2),
        mean_call_size=round(encoded / calls, 2),
    )


def median_figures(rounds: list[Figures]) -> Figures:
    return Figures(
        mode=rounds[0].mode,
        callers=rounds[0].callers,
        texts_per_s=statistics.median(f.texts_per_s for f in rounds),
        wait_ms_p50=statistics.median(f.wait_ms_p50 for f in rounds),
        wait_ms_p99=statistics.median(f.wait_ms_p99 for f in rounds),
        mean_call_size=statistics.median(f.mean_call_size for f in rounds),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--callers", default="1,6,12", help="comma list of concurrent callers")
    parser.add_argument("--texts", type=int, default=192, help="texts per caller count, mode and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the modes taking turns")
    parser.add_argument("--json", type=Path, help="write every figure here")


def run(args: argparse.Namespace) -> int:
    callers = [int(c) for c in args.callers.split(",")]
    embedder = Embedder(DEFAULT_EMBEDDING_MODEL)
    embedder._encode(questions(-1, 8))  # warm-up: the first call loads kernels
    print(f"embed coalescing: {args.texts} texts per run, {args.rounds} rounds, {machine_description()}")
    results: list[dict[str, object]] = []
    seed = 0
    for count in callers:
        rounds: dict[str, list[Figures]] = {"per text": [], "coalesced": []}
        # One pool for both modes and every round, kept like asyncio's executor keeps its threads;
        # warmed per text first, so each thread's first model call (its OpenMP pool) is not timed.
        with ThreadPoolExecutor(count) as pool:
            measure(embedder, "per text", pool, count, questions(-2, 4 * count))
            for r in range(args.rounds):
                order = ["per text", "coalesced"] if r % 2 == 0 else ["coalesced", "per text"]
                for mode in order:
                    seed += 1  # fresh texts every run: no memo hits
                    rounds[mode].append(measure(embedder, mode, pool, count, questions(seed, args.texts)))
        before, after = median_figures(rounds["per text"]), median_figures(rounds["coalesced"])
        ratio = round(after.texts_per_s / before.texts_per_s, 2)
        for f in (before, after):
            print(
                f"  {count:3d} callers  {f.mode:10s} {f.texts_per_s:7.1f} texts/s  wait p50 {f.wait_ms_p50:7.2f} ms"
                f"  p99 {f.wait_ms_p99:7.2f} ms  texts per model call {f.mean_call_size:5.2f}"
            )
        print(f"  {count:3d} callers  coalesced ÷ per text: {ratio}× texts/s")
        results.append(
            {
                "callers": count,
                "per_text": asdict(before),
                "coalesced": asdict(after),
                "texts_per_s_ratio": ratio,
                "rounds": {mode: [asdict(f) for f in figs] for mode, figs in rounds.items()},
            }
        )
    if args.json:
        report = {
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_description(),
            "texts": args.texts,
            "rounds": args.rounds,
            "results": results,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
