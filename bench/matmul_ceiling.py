"""What this CPU's fp32 matmuls reach on the model's own shapes: the ceiling a server cannot pass.

    python -m bench.matmul_ceiling               # rows 16, 64, 256, 1024
    llm-mesh bench matmul-ceiling --rows 48,512

Every linear layer of SmolLM2-135M (q/o 576×576, k/v 576×192, MLP 576×1536 and
1536×576, LM head 576×49152) through ``torch.nn.functional.linear`` at a number
of rows (tokens in one step: the batch for decode, the chunk for prefill), with
the torch thread count the engine uses. Prints GFLOP/s per row count: with it,
the least time any server needs for a workload's prompt and output tokens.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

#: (in, out) of every linear in one SmolLM2-135M layer, and the LM head.
SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))


def gflops(rows: int, seconds_per_shape: float = 0.5) -> float:
    flops = 0.0
    spent = 0.0
    for k, n in SHAPES:
        a, w = torch.randn(rows, k), torch.randn(n, k)
        for _ in range(3):
            torch.nn.functional.linear(a, w)
        start = time.perf_counter()
        calls = 0
        while (elapsed := time.perf_counter() - start) < seconds_per_shape:
            torch.nn.functional.linear(a, w)
            calls += 1
        flops += 2.0 * rows * k * n * calls
        spent += elapsed
    return flops / spent / 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", default="16,64,256,1024", help="comma list of rows per matmul")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    for rows in (int(r) for r in args.rows.split(",") if r.strip()):
        print(f"rows {rows:5d}: {gflops(rows):6.1f} GFLOP/s fp32 ({args.threads} threads)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
