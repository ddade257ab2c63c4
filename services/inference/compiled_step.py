"""``--compile`` for the native forward: its per-layer kernels through torch.compile, at warm-up.

What is compiled is ``layer_kernels``' four functions (RMSNorm, residual add +
RMSNorm, rotary, SiLU gate), not the whole step: the matmuls already run through
oneDNN with pre-packed weights (llama.Linear; inductor cannot lower that packed
op, and its own freezing would need the weights captured per layer, i.e. 30
graphs), and attention reads the decode slab or gathers paged blocks, whose
shapes change every step. The functions take every weight as an argument, so
one graph serves all layers.

Shapes. On CPU a kernel's row count is only a loop bound, so each function is
compiled once with the row dimension dynamic (``mark_dynamic``; one graph for
2..N rows) and once for a single row. On CUDA each function is compiled per row
bucket (``BATCH_BUCKETS`` up to the batch cap) with ``mode="reduce-overhead"``,
so each bucket runs as a captured CUDA graph; a step whose row count is not a
bucket runs those calls eagerly.

Calibration (CPU). A compiled kernel is not faster at every size: on a 2-vCPU
AVX-512 VM each compiled kernel took 1.1–3.1× eager's time at 1–16 rows (per-call
guards and launch cost on inputs this small) and 0.3–0.7× at 1,024–2,048 rows
(docs/inference.md). So at warm-up each kernel is timed both ways at every
power of two up to the step's largest row count, interleaved, and a bucket uses
the compiled kernel only where it won by ``_MIN_GAIN``; every other bucket runs
eagerly: ``--compile`` never makes a step slower than eager by the warm-up's own
measure.

Everything is compiled here, before the replica reports SERVING. Steps then run
under ``torch.compiler.set_stance("eager_on_recompile")``: a shape the warm-up
did not cover runs eagerly instead of compiling on a live request.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from services.inference import layer_kernels
from services.inference.layer_kernels import Kernels

log = logging.getLogger("llmmesh.inference.compile")

#: CUDA: row counts captured as graphs (tokens in a step; a decode step has one per row).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


#: CPU: a compiled kernel must beat eager by this share at warm-up to be used for a bucket.
#: Timed alone, kernels often win ~10 % at decode sizes, a win that did not survive inside a
#: step (`uniform` with a 5 % margin: 0.98× eager); at prefill sizes they win 30–70 %.
_MIN_GAIN = 0.2
#: CPU calibration: interleaved timing rounds per size (the median counts).
_CALIBRATION_ROUNDS = 7


def row_bucket(rows: int) -> int:
    """The power of two at or above ``rows``: the CPU calibration's bucket for a call."""
    return 1 << max(0, rows - 1).bit_length()


def faster_buckets(timings: dict[int, tuple[float, float]], min_gain: float = _MIN_GAIN) -> set[int]:
    """The buckets whose compiled time (second) beat the eager one (first) by ``min_gain``."""
    return {bucket for bucket, (eager, compiled) in timings.items() if compiled < eager * (1.0 - min_gain)}


class _Bucketed:
    """Calls the compiled function for warmed row counts, the eager one for any other."""

    def __init__(self, compiled: Callable[..., Any], eager: Callable[..., Any]) -> None:
        self.compiled = compiled
        self.eager = eager
        self.rows: set[int] | None = None  # CUDA: the captured row counts; None: every row count
        #: CPU: the row buckets (``row_bucket``) where the compiled kernel measured faster.
        self.buckets: set[int] | None = None

    def use_compiled(self, rows: int) -> bool:
        if self.buckets is not None:
            return row_bucket(rows) in self.buckets
        return self.rows is None or rows in self.rows

    def __call__(self, first: torch.Tensor, *args: Any) -> Any:
        fn = self.compiled if self.use_compiled(first.shape[0]) else self.eager
        return fn(first, *args)


def _eager_on_recompile() -> Any:
    return torch.compiler.set_stance("eager_on_recompile")


@contextlib.contextmanager
def _graph_step() -> Iterator[None]:
    # A new step: the graphs' output buffers of the last one may be reused (cudagraph trees).
    torch.compiler.cudagraph_mark_step_begin()
    with _eager_on_recompile():
        yield


def compile_kernels(
    *,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    dtype: torch.dtype,
    device: torch.device,
    max_rows: int,
) -> Kernels:
    """Compiles and warms the four kernels for ``device``; returns them as a ``Kernels`` set."""
    started = time.perf_counter()
    cuda = device.type == "cuda"
    mode = "reduce-overhead" if cuda else None
    eager = layer_kernels.EAGER
    fns = {
        name: _Bucketed(
            torch.compile(getattr(eager, name), dynamic=False if cuda else None, mode=mode),
            getattr(eager, name),
        )
        for name in ("rms_norm", "add_rms_norm", "rotary", "silu_mul")
    }
    # CPU: a single row, and one dynamic graph (traced at 64 rows) for every count >= 2.
    rows_to_warm = [b for b in BATCH_BUCKETS if b <= max_rows] if cuda else [1, 64]
    warm_inputs = _kernel_inputs(
        hidden, intermediate, heads, kv_heads, head_dim, eps, dtype, device, dynamic_rows=not cuda
    )
    with torch.inference_mode():
        for rows in rows_to_warm:
            for _ in range(3 if cuda else 1):  # reduce-overhead records its graph on a later call
                for name, fn in fns.items():
                    fn(*warm_inputs[name](rows))
    if cuda:
        for fn in fns.values():
            fn.rows = set(rows_to_warm)
    else:
        inputs = _kernel_inputs(hidden, intermediate, heads, kv_heads, head_dim, eps, dtype, device)
        sizes = [1 << k for k in range(max(1, max_rows - 1).bit_length() + 1)]
        with torch.inference_mode(), _eager_on_recompile():
            for name, fn in fns.items():
                fn.buckets = faster_buckets({rows: _time_both(fn, inputs[name](rows)) for rows in sizes})
                log.info("compiled %s used for row buckets %s of %s", name, sorted(fn.buckets), sizes)
    log.info("compiled the layer kernels for %s rows in %.1fs", rows_to_warm, time.perf_counter() - started)
    return Kernels(
        rms_norm=fns["rms_norm"],
        add_rms_norm=fns["add_rms_norm"],
        rotary=fns["rotary"],
        silu_mul=fns["silu_mul"],
        step_scope=_graph_step if cuda else _eager_on_recompile,
    )


def _kernel_inputs(
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    dtype: torch.dtype,
    device: torch.device,
    dynamic_rows: bool = False,
) -> dict[str, Callable[[int], tuple[Any, ...]]]:
    """Per kernel: the arguments of one call at a given row count, as the forward passes them.

    ``dynamic_rows`` marks the row dimension dynamic when there are 2 or more rows: what
    the CPU warm-up traces, so that one graph serves every row count >= 2.
    """
    weight = torch.ones(hidden, dtype=dtype, device=device)
    qkv_width = (heads + 2 * kv_heads) * head_dim

    def rand(rows: int, *shape: int) -> torch.Tensor:
        t = torch.randn(rows, *shape, dtype=dtype, device=device)
        if dynamic_rows and rows > 1:
            torch._dynamo.mark_dynamic(t, 0)
        return t

    return {
        "rms_norm": lambda rows: (rand(rows, hidden), weight, eps),
        "add_rms_norm": lambda rows: (rand(rows, hidden), rand(rows, hidden), weight, eps),
        "rotary": lambda rows: (
            rand(rows, qkv_width),
            rand(rows, 1, head_dim),
            rand(rows, 1, head_dim),
            heads,
            kv_heads,
            head_dim,
        ),
        "silu_mul": lambda rows: (rand(rows, 2 * intermediate),),
    }


def _time_both(fn: _Bucketed, args: tuple[Any, ...]) -> tuple[float, float]:
    """Median seconds of one eager and one compiled call on ``args``, interleaved so drift hits both."""
    eager: list[float] = []
    compiled: list[float] = []
    fn.eager(*args)
    fn.compiled(*args)
    for _ in range(_CALIBRATION_ROUNDS):
        for variant, out in ((fn.eager, eager), (fn.compiled, compiled)):
            started = time.perf_counter()
            variant(*args)
            out.append(time.perf_counter() - started)
    return sorted(eager)[len(eager) // 2], sorted(compiled)[len(compiled) // 2]
