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


class _Bucketed:
    """Calls the compiled function for warmed row counts, the eager one for any other."""

    def __init__(self, compiled: Callable[..., Any], eager: Callable[..., Any]) -> None:
        self.compiled = compiled
        self.eager = eager
        self.rows: set[int] | None = None  # None: every row count (a dynamic graph)

    def __call__(self, first: torch.Tensor, *args: Any) -> Any:
        fn = self.compiled if self.rows is None or first.shape[0] in self.rows else self.eager
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
    qkv_width = (heads + 2 * kv_heads) * head_dim

    def sample(rows: int, *shape: int) -> torch.Tensor:
        t = torch.randn(rows, *shape, dtype=dtype, device=device)
        if not cuda and rows > 1:
            torch._dynamo.mark_dynamic(t, 0)  # one graph for every row count >= 2
        return t

    weight = torch.ones(hidden, dtype=dtype, device=device)
    with torch.inference_mode():
        for rows in rows_to_warm:
            for _ in range(3 if cuda else 1):  # reduce-overhead records its graph on a later call
                fns["rms_norm"](sample(rows, hidden), weight, eps)
                fns["add_rms_norm"](sample(rows, hidden), sample(rows, hidden), weight, eps)
                fns["rotary"](
                    sample(rows, qkv_width),
                    sample(rows, 1, head_dim),
                    sample(rows, 1, head_dim),
                    heads,
                    kv_heads,
                    head_dim,
                )
                fns["silu_mul"](sample(rows, 2 * intermediate))
    if cuda:
        for fn in fns.values():
            fn.rows = set(rows_to_warm)
    log.info("compiled the layer kernels for %s rows in %.1fs", rows_to_warm, time.perf_counter() - started)
    return Kernels(
        rms_norm=fns["rms_norm"],
        add_rms_norm=fns["add_rms_norm"],
        rotary=fns["rotary"],
        silu_mul=fns["silu_mul"],
        step_scope=_graph_step if cuda else _eager_on_recompile,
    )
