"""What this CPU's matmuls reach on the model's own shapes: the ceiling a server cannot pass.

    python -m bench.matmul_ceiling               # rows 16, 64, 256, 1024, fp32
    llm-mesh bench matmul-ceiling --rows 48,512 --dtype bfloat16

Every linear layer of SmolLM2-135M (q/o 576×576, k/v 576×192, MLP 576×1536 and
1536×576, LM head 576×49152) at a number of rows (tokens in one step: the batch
for decode, the chunk for prefill), with the torch thread count the engine uses,
each shape through the faster of ``torch.nn.functional.linear`` and, on CPU,
oneDNN with the weight pre-packed (what llm-mesh's forward and inductor's frozen
graphs call). Until 2026-12-05 only ``F.linear`` was timed: on the AVX-512/BF16
VM packing reached 1.2–1.4× its GFLOP/s in bf16 and 1.5–1.6× in fp32 at 64 rows,
so shares of the ceiling printed before then were too high by as much. Prints GFLOP/s per row count: with it,
the least time any server needs for a workload's prompt and output tokens.
``bench/engine.py`` prints ``ceiling_tok_s`` beside its results (the engine's share
of it), measured in the same run at the batch's rows and the run's dtype.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch

#: (in, out) of every linear in one SmolLM2-135M layer, and the LM head.
SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))


#: FLOPs of one decoded token of SmolLM2-135M through its linears: 30 layers (q, k, v, o,
#: gate, up, down) and the LM head, 2 per multiply-add (≈ 269 MFLOP).
LAYERS = 30
FLOPS_PER_TOKEN = 2.0 * (LAYERS * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) + 576 * 49152)


def gflops(
    rows: int, seconds_per_shape: float = 0.5, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> float:
    """GFLOP/s of the faster matmul path over the model's shapes at ``rows`` rows, in ``dtype``."""
    flops = 0.0
    spent = 0.0
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for k, n in SHAPES:
        a = torch.randn(rows, k, device=device).to(dtype)
        w = torch.randn(n, k, device=device).to(dtype)
        # Each path's calls per second on this shape; the faster one counts.
        best_rate = max(_calls_per_s(path, seconds_per_shape, sync) for path in _paths(a, w))
        flops += 2.0 * rows * k * n * best_rate * seconds_per_shape
        spent += seconds_per_shape
    return flops / spent / 1e9


def _paths(a: torch.Tensor, w: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
    """``a @ w.T`` by every path a server on this device may take."""
    paths: list[Callable[[], torch.Tensor]] = [lambda: torch.nn.functional.linear(a, w)]
    if a.device.type == "cpu" and torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, a.shape[0])
        except RuntimeError:
            return paths  # a dtype oneDNN does not pack
        paths.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    return paths


def _calls_per_s(call: Callable[[], torch.Tensor], seconds: float, sync: Callable[[], None]) -> float:
    for _ in range(3):
        call()
    start = time.perf_counter()
    calls = 0
    while (elapsed := time.perf_counter() - start) < seconds:
        call()
        calls += 1
        sync()
    return calls / elapsed


#: (in, out) of one layer's linears as the engine runs them: q/k/v fused, o, gate/up fused, down.
STEP_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
LM_HEAD = (576, 49152)


def step_linears_gflops(
    rows: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seconds: float = 1.0,
    layers: int = LAYERS,
) -> float:
    """GFLOP/s of one decode step's linears at ``rows`` rows, run as a step runs them.

    ``gflops`` times each shape on its own, again and again on the same weights, so they sit
    in the CPU's caches: the most a kernel gives. A step reads each layer's own weights once
    (≈ 270 MB in bf16 for SmolLM2-135M, far past any cache) and meets each shape once. So
    here every layer has its own weights (fused as the engine fuses them, packed as its
    graphs pack them), and a pass is the layers in order, then the LM head: what the engine's
    linears cost at best with this machine's kernels. On the Intel AMX VM, 2026-12-05, bf16 at
    64 rows, three pairs a minute apart: 885 / 713 / 959 GFLOP/s against ``gflops``' 1,104 /
    816 / 1,111 (80–87 %); a 64-row compiled decode step at span 96 took 33.2 ms, of which
    these linears ≈ 17 and attention ≈ 14 (timed alone in the same process).
    """
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    calls: list[Callable[[], torch.Tensor]] = []
    inputs = {k: torch.randn(rows, k, device=device).to(dtype) for k, _ in (*STEP_SHAPES, LM_HEAD)}
    for k, n in (*(shape for _ in range(layers) for shape in STEP_SHAPES), LM_HEAD):
        w = torch.randn(n, k, device=device).to(dtype)
        calls.append(_paths(inputs[k], w)[-1])  # the packed path on CPU, where it exists
    flops = 2.0 * rows * (layers * sum(k * n for k, n in STEP_SHAPES) + LM_HEAD[0] * LM_HEAD[1])

    def one_step() -> torch.Tensor:
        for call in calls:
            out = call()
        return out

    return flops * _calls_per_s(one_step, seconds, sync) / 1e9


def ceiling_tok_s(
    rows: int, dtype: torch.dtype, device: str = "cpu", seconds_per_shape: float = 0.3
) -> dict[str, float]:
    """The decode ceiling at ``rows`` rows: matmul GFLOP/s and the tokens/s it allows; beside
    it what one step's linears reach with their own weights (``step_linears_gflops``)."""
    rate = gflops(rows, seconds_per_shape, dtype, device)
    step = step_linears_gflops(rows, dtype, device)
    return {
        "rows": rows,
        "gflops": rate,
        "tok_s": rate * 1e9 / FLOPS_PER_TOKEN,
        "step_linears_gflops": step,
        "step_linears_tok_s": step * 1e9 / FLOPS_PER_TOKEN,
    }


def best_of(measurements: list[dict[str, float]]) -> dict[str, Any]:
    """One ceiling from several ``ceiling_tok_s`` measurements of the same rows: each figure's best
    (the rows too, being the same).

    A ceiling is the most the hardware did, and on a shared VM noise only ever takes some away:
    on the Intel AMX VM, 2026-12-05, one measurement moved 1,104 → 639 GFLOP/s within 20
    minutes. The measurements themselves are kept beside it.
    """
    best: dict[str, Any] = {key: max(m[key] for m in measurements) for key in measurements[0]}
    best["measurements"] = measurements
    return best


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", default="16,64,256,1024", help="comma list of rows per matmul")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    for rows in (int(r) for r in args.rows.split(",") if r.strip()):
        c = ceiling_tok_s(rows, dtype, seconds_per_shape=0.5)
        print(
            f"rows {rows:5d}: {c['gflops']:6.1f} GFLOP/s {args.dtype} ({args.threads} threads), "
            f"≈ {c['tok_s']:,.0f} tok/s; one step's linears {c['step_linears_gflops']:6.1f} GFLOP/s "
            f"≈ {c['step_linears_tok_s']:,.0f} tok/s",
            flush=True,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
