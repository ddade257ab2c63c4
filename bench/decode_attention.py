"""Decode attention over the slab: the engine's two matmuls against the library kernels.

    python -m bench.decode_attention                       # 64 rows, spans 64/128/256, bf16
    llm-mesh bench decode-attention --rows 32 --spans 96 --dtype float32

One layer of a 64-row decode step spends more on attention than on any of its
linears (docs/benchmarks.md, 2026-12-06 13:44), so each kernel PyTorch ships for it
is timed here on SmolLM2-135M's shapes (9 query heads over 3 KV heads of 64), every
row a different length as in a real batch:

- ``matmul``: ``llama.slab_attention``, what the engine runs (two batched matmuls, a
  softmax), eager and under ``torch.compile``;
- ``flex``: FlexAttention (``torch.nn.attention.flex_attention``), compiled (its CPU
  path is inductor's C++ flash-attention template), the lengths as a ``score_mod``;
- ``sdpa``: ``scaled_dot_product_attention`` with ``enable_gqa`` and a boolean mask.

Each variant's best of interleaved rounds, its ratio to the engine's, and its largest
difference from an fp32 reference. Exit status 1 if a variant's output is wrong.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import torch
import torch.nn.functional as F

from bench.engine import machine_description
from services.inference import llama

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
#: Largest |difference| from the fp32 reference an output may show, per dtype (bf16 keeps
#: 8 bits of mantissa; the probabilities are rounded to it before they weigh the values).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def inputs(rows: int, span: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """One layer's decode inputs: queries, slab keys and values, each row's length and its mask."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    keys = torch.randn(rows, KV_HEADS, span, HEAD_DIM, generator=gen).to(dtype)
    values = torch.randn(rows, KV_HEADS, span, HEAD_DIM, generator=gen).to(dtype)
    lengths = torch.randint(max(1, span // 2), span + 1, (rows,), generator=gen)
    visible = torch.arange(span)[None, :] < lengths[:, None]  # [rows, span]
    bias = torch.zeros(rows, span).masked_fill(~visible, float("-inf")).to(dtype)
    return {
        "q": q,
        "keys": keys,
        "values": values,
        "lengths": lengths,
        "mask_bias": bias.view(rows, 1, 1, span),
        "visible": visible.view(rows, 1, 1, span),
    }


def reference(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 attention of every query head over its KV head, row by row's length."""
    q, keys, values = x["q"].float(), x["keys"].float(), x["values"].float()
    group = HEADS // KV_HEADS
    scores = torch.einsum("bhd,bhsd->bhs", q, keys.repeat_interleave(group, dim=1)) * HEAD_DIM**-0.5
    scores = scores.masked_fill(~x["visible"].view(q.shape[0], 1, -1), float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), values.repeat_interleave(group, dim=1))


def engine_attention(x: dict[str, torch.Tensor]) -> torch.Tensor:
    return llama.slab_attention(x["q"], x["keys"], x["values"], x["mask_bias"], HEAD_DIM**-0.5)


def flex_attention(x: dict[str, torch.Tensor]) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention as flex

    lengths = x["lengths"]

    def within(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
        return torch.where(kv_idx < lengths[b], score, -float("inf"))

    # A 4-d query as a graph input: a [rows, heads, D] input viewed as 4-d inside the graph fails
    # inductor's CPU lowering in torch 2.13 ("not enough values to unpack").
    out = flex(x["q4"], x["keys"], x["values"], score_mod=within, enable_gqa=True, scale=HEAD_DIM**-0.5)
    return out.reshape(x["q"].shape)


def sdpa_attention(x: dict[str, torch.Tensor]) -> torch.Tensor:
    rows = x["q"].shape[0]
    out = F.scaled_dot_product_attention(
        x["q"].view(rows, HEADS, 1, HEAD_DIM),
        x["keys"],
        x["values"],
        attn_mask=x["visible"],
        enable_gqa=True,
        scale=HEAD_DIM**-0.5,
    )
    return out.reshape(x["q"].shape)


def variants() -> dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]]:
    return {
        "matmul": engine_attention,
        "matmul_compiled": torch.compile(engine_attention, dynamic=False),
        "flex_compiled": torch.compile(flex_attention, dynamic=False),
        "sdpa": sdpa_attention,
    }


def best_us(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(rows: int, span: int, dtype: torch.dtype, rounds: int, calls: int) -> dict[str, Any]:
    x = inputs(rows, span, dtype)
    x["q4"] = x["q"].view(rows, HEADS, 1, HEAD_DIM).clone()
    expected = reference(x)
    results: dict[str, Any] = {}
    runs = variants()
    for name, fn in runs.items():
        started = time.perf_counter()
        out = fn(x)  # compiles the compiled ones
        results[name] = {
            "first_call_s": round(time.perf_counter() - started, 2),
            "max_abs_diff": float((out.float() - expected).abs().max()),
            "us": float("inf"),
        }
    for _ in range(rounds):  # interleaved: drift moves every variant alike
        for name, fn in runs.items():
            results[name]["us"] = min(results[name]["us"], best_us(functools.partial(fn, x), calls))
    base = results["matmul"]["us"]
    for r in results.values():
        r["us"] = round(r["us"], 1)
        r["vs_engine"] = round(r["us"] / base, 2)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=64, help="decode rows (one query each)")
    parser.add_argument("--spans", default="64,128,256", help="comma-separated slab lengths")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds; each variant's best counts"
    )
    parser.add_argument("--calls", type=int, default=50, help="calls timed per round")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPUs)")
    parser.add_argument("--output", default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    dtype = getattr(torch, args.dtype)
    spans = [int(s) for s in args.spans.split(",")]
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "torch": torch.__version__,
        "rows": args.rows,
        "dtype": args.dtype,
        "spans": {},
    }
    wrong = []
    for span in spans:
        results = measure(args.rows, span, dtype, args.rounds, args.calls)
        report["spans"][span] = results
        line = ", ".join(f"{n} {r['us']:.0f} µs ({r['vs_engine']:.2f}×)" for n, r in results.items())
        print(f"{args.rows} rows, span {span}, {args.dtype}: {line}", flush=True)
        wrong += [
            f"{n} at span {span}: off by {r['max_abs_diff']:.3g}"
            for n, r in results.items()
            if not r["max_abs_diff"] <= TOLERANCE[dtype]
        ]
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    for w in wrong:
        print(f"WRONG: {w}")
    return 1 if wrong else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))


if __name__ == "__main__":
    main()
