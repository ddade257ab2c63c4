"""Micro-benchmark: the router's CPU to score one request with the prefix policy.

A 2,000-token prompt (125 blocks of 16) against 3–8 replicas with 10,000 indexed blocks
each: scoring and choice (PrefillWork and QueuedWork for every candidate, the bound, argmin
with its hash tie-break: ``policy.select``), the whole placement (the picker's filters and
pin check too, and the approximate record of where it went: ``picker.place``), and the
index lookups alone. The goal (issue #22): scoring
≤ 0.2 ms p99. Prints p50/p99 in microseconds per placement,
of this thread's CPU time and of the wall clock.

    python -m bench.placement_scoring [--iterations 20000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.router.placement.picker import ReplicaPicker
from services.router.placement.policies import PrefixPolicy
from services.router.placement.prefix_index import PrefixIndex
from services.router.placement.request import PlacementRequest, PromptPrefix

BLOCK_SIZE = 16
PROMPT_BLOCKS = 125  # 2,000 tokens
INDEXED_BLOCKS = 10_000
U64 = (1 << 64) - 1


@dataclass
class BenchReplica:
    """A pool member as the prefix policy reads it (the pool's ``Replica`` needs a channel)."""

    address: str
    reported_load: int
    prefill_s_per_token: float | None = 2e-4
    decode_s_per_request: float | None = 0.2
    in_flight: int = 0
    queue_depth: int = 0
    ewma_ttft_s: float | None = None
    ewma_itl_s: float | None = None

    def predicted_wait_s(self) -> float:
        return 0.0


@dataclass
class BenchPool:
    replicas: list[BenchReplica]

    def candidates(self, model: str) -> list[BenchReplica]:
        return self.replicas


def percentiles(samples_ns: list[int]) -> tuple[float, float]:
    """p50 and p99 in microseconds."""
    cuts = statistics.quantiles(samples_ns, n=100)
    return cuts[49] / 1000, cuts[98] / 1000


@dataclass(frozen=True)
class Timing:
    """p50/p99 of one call in µs: wall clock, and this thread's CPU time (what the router pays;
    on a shared machine the wall-clock tail is mostly other processes preempting this one)."""

    wall: tuple[float, float]
    cpu: tuple[float, float]

    def __str__(self) -> str:
        return (
            f"CPU p50 {self.cpu[0]:.1f} µs p99 {self.cpu[1]:.1f} µs"
            f" (wall p50 {self.wall[0]:.1f} p99 {self.wall[1]:.1f})"
        )


def timed(call: Callable[[], object], iterations: int) -> Timing:
    wall_clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    wall, cpu = [], []
    for _ in range(iterations):
        began, began_cpu = wall_clock(), cpu_clock()
        call()
        cpu.append(cpu_clock() - began_cpu)
        wall.append(wall_clock() - began)
    return Timing(percentiles(wall), percentiles(cpu))


def setup(
    replicas: int, rng: random.Random
) -> tuple[ReplicaPicker[BenchReplica], PrefixIndex, list[list[int]]]:
    """Replicas each holding 10k blocks; prompts of 8 groups cached to various depths on some of them."""
    index = PrefixIndex()
    groups = [[rng.randint(0, U64) for _ in range(PROMPT_BLOCKS)] for _ in range(8)]
    pool = []
    for r in range(replicas):
        address = f"10.0.0.{r}:50052"
        held = {rng.randint(0, U64) for _ in range(INDEXED_BLOCKS)}
        for g, chain in enumerate(groups):
            if (g + r) % 3 == 0:
                held.update(chain[: PROMPT_BLOCKS * (1 + (g + r) % 4) // 4])
        index.apply_snapshot(address, "bench", 1, BLOCK_SIZE, list(held)[:INDEXED_BLOCKS])
        pool.append(BenchReplica(address, reported_load=rng.randint(0, 8)))
    return ReplicaPicker(BenchPool(pool), PrefixPolicy(index), clock=lambda: 0.0), index, groups


def run(replicas: int, iterations: int, rng: random.Random) -> None:
    picker, index, groups = setup(replicas, rng)
    requests = [
        PlacementRequest(["m"], request_id=f"r{i}", prefix=PromptPrefix(groups[i % 8], BLOCK_SIZE))
        for i in range(64)
    ]
    candidates = picker.pool.candidates("m")
    addresses = [r.address for r in candidates]
    turn = iter(range(1 << 62))

    def score() -> object:
        return picker.policy.select(candidates, requests[next(turn) % 64])

    def place() -> object:
        return picker.place(requests[next(turn) % 64])

    def lookups() -> object:
        chain = groups[next(turn) % 8]
        return [index.cached_prefix_blocks(a, chain, BLOCK_SIZE) for a in addresses]

    for _ in range(1000):  # warm up
        place()
    print(f"{replicas} replicas, scoring and choice:  {timed(score, iterations)}")
    print(f"{replicas} replicas, whole placement:     {timed(place, iterations)}")
    print(f"{replicas} replicas, index lookups alone: {timed(lookups, iterations)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20_000)
    args = parser.parse_args()
    rng = random.Random(22)
    print(f"prompt {PROMPT_BLOCKS} blocks of {BLOCK_SIZE}, {INDEXED_BLOCKS} indexed blocks per replica")
    for replicas in (3, 8):
        run(replicas, args.iterations, rng)


if __name__ == "__main__":
    main()
