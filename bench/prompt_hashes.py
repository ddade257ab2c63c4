"""The router's CPU per placement for a 2,000-token chat prompt: render + tokenize, hash, score.

    python -m bench.prompt_hashes [--model models/SmolLM2-135M-Instruct] [--rounds 500]

Renders a chat request (system prompt + question) through the model's chat template and
tokenizer exactly as the router does (``PromptHasher``: once with the system prompt shared by
every round, the workload prefix placement is for, once with a new one each round), hashes its 16-token blocks with the
mesh-wide XXH3 chain (``services/common/kv_blocks.py``), and scores it against a prefix index
of 8 replicas holding 10,000 blocks each, one of them the prompt's. Prints p50/p99 of each part
and of the whole (the issue's budget: ≤ 2 ms p99) — on the calling thread, and as a turn gets
it, through the hasher's worker thread from an event loop (``await PromptHasher.prefix``) —
and the blake2b alternative's hash time.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import statistics
import time
from array import array
from collections.abc import Callable
from pathlib import Path

from services.common.kv_blocks import block_hashes
from services.gen.llmmesh.v1 import common_pb2, inference_pb2
from services.router.placement.prefix_index import PrefixIndex
from services.router.placement.prompt_hashes import PromptHasher, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
REPLICAS = 8
BLOCKS_PER_REPLICA = 10_000


def blake2b_chain(token_ids: list[int], block_size: int) -> list[int]:
    data = array("I", token_ids).tobytes()
    parent, out = b"\0" * 8, []
    width = 4 * block_size
    for s in range(0, len(token_ids) // block_size * width, width):
        parent = hashlib.blake2b(parent + data[s : s + width], digest_size=8).digest()
        out.append(int.from_bytes(parent, "little"))
    return out


def timed(fn: Callable[[], object], rounds: int) -> list[float]:
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1000)
    return samples


def p(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100)[int(q) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--rounds", type=int, default=500)
    args = parser.parse_args()
    hasher = PromptHasher(load_tokenizer(args.model), block_size=lambda model: BLOCK)
    rng = random.Random(22)
    words = [
        "order",
        "shipping",
        "refund",
        "invoice",
        "parcel",
        "delay",
        "address",
        "courier",
        "stock",
        "price",
    ]
    system = " ".join(rng.choice(words) for _ in range(1950))
    start = inference_pb2.GenerateStart(
        messages=[
            common_pb2.ChatMessage(role="system", content=system),
            common_pb2.ChatMessage(role="user", content="Where is my parcel?"),
        ]
    )
    ids = hasher.token_ids(start)
    assert ids is not None
    chain = block_hashes(ids, BLOCK)
    index = PrefixIndex()
    for r in range(REPLICAS):
        held = set(chain) if r == 0 else set()
        while len(held) < BLOCKS_PER_REPLICA:
            held.add(rng.getrandbits(64))
        index.apply_snapshot(f"r{r}", "bench", 0, BLOCK, held)

    # Every round another system prompt: nothing cached, the tokenizer's own speed.
    fresh = iter(
        [
            inference_pb2.GenerateStart(
                messages=[common_pb2.ChatMessage(role="system", content=f"{i} {system}"), start.messages[1]]
            )
            for i in range(args.rounds)
        ]
    )

    def score() -> list[int]:
        return [index.cached_prefix_blocks(f"r{r}", chain, BLOCK) for r in range(REPLICAS)]

    def whole() -> object:
        _, hashes = hasher.hashes(start, BLOCK)
        return [index.cached_prefix_blocks(f"r{r}", hashes, BLOCK) for r in range(REPLICAS)]

    def through_the_worker() -> list[float]:
        """The whole placement input as a turn gets it: hashed on the worker thread, awaited on a loop."""

        async def rounds() -> list[float]:
            samples = []
            for _ in range(args.rounds):
                t = time.perf_counter()
                prefix = await hasher.prefix(start, "m")
                [index.cached_prefix_blocks(f"r{r}", prefix.hashes, BLOCK) for r in range(REPLICAS)]
                samples.append((time.perf_counter() - t) * 1000)
            return samples

        return asyncio.run(rounds())

    parts = {
        "render + tokenize (shared system prompt)": timed(lambda: hasher.token_ids(start), args.rounds),
        "render + tokenize (unique prompt)": timed(lambda: hasher.token_ids(next(fresh)), args.rounds),
        "hash (xxh3 chain)": timed(lambda: block_hashes(ids, BLOCK), args.rounds),
        "hash (blake2b chain, not used)": timed(lambda: blake2b_chain(ids, BLOCK), args.rounds),
        f"score ({REPLICAS} replicas x {BLOCKS_PER_REPLICA} blocks)": timed(score, args.rounds),
        "whole placement input": timed(whole, args.rounds),
        "whole, through the worker thread": through_the_worker(),
    }
    hasher.close()
    load = os.getloadavg()[0]
    print(f"{len(ids)} prompt tokens, {len(chain)} blocks of {BLOCK}, {args.rounds} rounds, load {load:.2f}")
    for name, samples in parts.items():
        print(f"{name:44s} p50 {p(samples, 50):7.3f} ms   p99 {p(samples, 99):7.3f} ms")


if __name__ == "__main__":
    main()
