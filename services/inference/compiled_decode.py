"""``--compile`` on CPU: a whole decode step over the slab as one inductor graph.

The per-layer kernels of compiled_step.py fuse a few elementwise ops each, but a
64-row decode step is still ~1,500 operator calls, each paying Python and
dispatcher overhead (~5–10 µs) on inputs of a few hundred KB: tens of ms a step,
as much as everything but the matmuls. Here the step itself — embedding, the 30
layers (fused QKV and gate/up matmuls, rotary, the K/V writes into the paged
cache and the slab, attention over the slab, norms and residuals) — is one
``torch.compile`` graph with inductor's freezing (it packs the matmul weights for
oneDNN itself, so the graph holds its own packed copy) and the C++ wrapper (the
graph's calls run without the Python interpreter between them). A 64-row bf16
step went from ≈ 98 to ≈ 63 ms in a prototype (docs/benchmarks.md).

Only pure decode steps whose rows sit in the decode slab take the graph: their
shapes are [rows] and [rows, span] with both dimensions dynamic, so one graph
serves every row count >= 2 and every slab length. A single row (one client
streaming alone, the end of every burst) would make dynamo specialise a second
graph (another ~85 s of start-up), so it runs as two: a pad row beside it that
writes only the paged cache's spare padding slot and a slab row no sequence holds
(``_padded_to_two_rows``). Weight reads set a small step's time, so the pad row
is nearly free: at 192 positions two rows took 17.3 ms through the graph, one row
16.4–17.0 ms through a one-row graph traced for the comparison and 25 ms eagerly
(bf16, AMX VM, 2026-12-05). Prefill and mixed steps run eagerly. The math is
layer_kernels' and llama.slab_attention's, the same functions the eager forward
calls, so fp32 greedy tokens stay transformers'.

Like compiled_step.py, everything is compiled at warm-up (before SERVING), each
row bucket is timed both ways and uses the graph only where it won, and steps
run under ``eager_on_recompile`` so a shape the warm-up did not cover never
compiles on a live request.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from services.inference import layer_kernels, llama
from services.inference.compiled_step import faster_buckets, row_bucket

if TYPE_CHECKING:
    from services.inference.decode_slab import DecodeSlab

log = logging.getLogger("llmmesh.inference.compile")

#: A bucket uses the graph only if it beat eager by this share at warm-up.
MIN_GAIN = 0.05
#: Interleaved timing rounds per bucket at warm-up; each side's fastest round counts. On a
#: shared VM noise only ever adds time, and a median of 3 was seen to call the 64-row bucket a
#: tie (63.2/63.2 ms) in one start-up and a 28 % win (76.9/55.7) in the next, which sent a whole
#: benchmark run's full-batch steps through the eager forward.
CALIBRATION_ROUNDS = 5
#: What compiling the decode step holds beside the graph's packed weights: dynamo's and
#: inductor's state for the graph and its loaded C++ module. Measured 2026-12-05 in bf16 on
#: SmolLM2-135M: RSS grew 526 MiB over the compile, of which 202 MiB the packed weights and
#: 118 MiB the warm-up's slab (kept by the heap for the live slab, which its budget counts).
COMPILE_STATE_BYTES = 256 << 20
#: The slab length the warm-up traces (dynamic: any length then runs the same graph), and the
#: one it times both ways at.
TRACE_LENGTH = 80
WARM_LENGTH = 64


class DecodeStep(torch.nn.Module):
    """One decode step of a ``LlamaForward`` (built with ``keep_weights``), as a module.

    The weights are the forward's own tensors, registered as buffers so inductor's
    freezing treats them as constants; nothing is copied here.
    """

    embed: torch.Tensor
    final_norm: torch.Tensor

    def __init__(self, forward: llama.LlamaForward) -> None:
        super().__init__()
        self.num_heads = forward.num_heads
        self.num_kv_heads = forward.num_kv_heads
        self.head_dim = forward.head_dim
        self.eps = forward.eps
        self.scale = forward.scale
        self.num_layers = len(forward.layers)
        self.register_buffer("embed", forward.embed, persistent=False)
        self.register_buffer("final_norm", forward.final_norm, persistent=False)
        for i, layer in enumerate(forward.layers):
            self.register_buffer(f"input_norm{i}", layer.input_norm, persistent=False)
            self.register_buffer(f"post_norm{i}", layer.post_attention_norm, persistent=False)
            self.register_buffer(f"qkv{i}", layer.qkv.plain, persistent=False)
            self.register_buffer(f"o{i}", layer.o.plain, persistent=False)
            self.register_buffer(f"gate_up{i}", layer.gate_up.plain, persistent=False)
            self.register_buffer(f"down{i}", layer.down.plain, persistent=False)

    def _w(self, name: str, i: int) -> torch.Tensor:
        return getattr(self, f"{name}{i}")  # type: ignore[no-any-return]

    def forward(
        self,
        input_ids: torch.Tensor,  # [n]
        cos: torch.Tensor,  # [n, 1, D]
        sin: torch.Tensor,  # [n, 1, D]
        positions: torch.Tensor,  # [n] each row's new position
        mask_bias: torch.Tensor,  # [n, 1, 1, span]
        slot_mapping: torch.Tensor,  # [n] paged-cache slot of each row's new K/V
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        slab_k: list[torch.Tensor],  # per layer [slab rows, kv_heads, length, D]; row i is batch row i
        slab_v: list[torch.Tensor],
    ) -> torch.Tensor:
        """The final-normed hidden state of every row: [n, hidden]."""
        n = input_ids.shape[0]
        span = mask_bias.shape[-1]
        heads, kv_heads, dim, eps = self.num_heads, self.num_kv_heads, self.head_dim, self.eps
        x = self.embed.index_select(0, input_ids)
        h = layer_kernels.rms_norm(x, self._w("input_norm", 0), eps)
        for i in range(self.num_layers):
            qkv = torch.nn.functional.linear(h, self._w("qkv", i))
            q, k, v = layer_kernels.rotary(qkv, cos, sin, heads, kv_heads, dim)
            k_caches[i].index_copy_(1, slot_mapping, k.transpose(0, 1))
            v_caches[i].index_copy_(1, slot_mapping, v.transpose(0, 1))
            llama.write_slab_rows(slab_k[i], slab_v[i], positions, k, v)
            keys = slab_k[i][:n, :, :span]
            values = slab_v[i][:n, :, :span]
            attn = llama.slab_attention(q, keys, values, mask_bias, self.scale)
            o = torch.nn.functional.linear(attn.reshape(n, heads * dim), self._w("o", i))
            x, h = layer_kernels.add_rms_norm(x, o, self._w("post_norm", i), eps)
            gate_up = torch.nn.functional.linear(h, self._w("gate_up", i))
            down = torch.nn.functional.linear(layer_kernels.silu_mul(gate_up), self._w("down", i))
            if i + 1 < self.num_layers:
                x, h = layer_kernels.add_rms_norm(x, down, self._w("input_norm", i + 1), eps)
            else:
                x = x + down
        return layer_kernels.rms_norm(x, self.final_norm, eps)


class CompiledDecode:
    """The compiled ``DecodeStep`` and the row buckets where it beat eager at warm-up."""

    def __init__(self, forward: llama.LlamaForward, whole_length: bool) -> None:
        self.module = DecodeStep(forward).eval()
        #: Which steps the graph was traced for: span == the slab's length, or shorter.
        self.whole_length = whole_length
        self.graph: Any = torch.compile(self.module)
        #: Row buckets (compiled_step.row_bucket) that take the graph; empty until calibrated.
        self.buckets: set[int] = set()
        #: What a step whose shapes the graph's guards reject does: run eagerly (tests: fail).
        self.stance = "eager_on_recompile"
        #: The paged cache's spare slot, where a single row's pad row writes its K/V.
        self.pad_slot = -1

    def usable(self, step: llama.StepInputs) -> bool:
        decode = step.decode
        return (
            step.prefill is None
            and decode is not None
            and decode.slab is not None
            # One row runs padded to two: the slab must have a second row (it has MIN_ROWS
            # unless the replica's row cap is 1).
            and (decode.count >= 2 or (decode.count == 1 and decode.slab.rows >= 2 and self.pad_slot >= 0))
            and (decode.span == decode.slab.length) == self.whole_length
            and row_bucket(decode.count) in self.buckets
        )

    def __call__(
        self,
        step: llama.StepInputs,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        decode = step.decode
        assert decode is not None and decode.slab is not None and decode.positions is not None
        # A step the warm-up's graph does not cover runs eagerly: never a compile on a live request.
        with torch.compiler.set_stance(self.stance):  # type: ignore[arg-type]
            return self.trace(step, cos, sin, k_caches, v_caches)

    def trace(
        self,
        step: llama.StepInputs,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Calls the graph under the caller's stance: at warm-up, where it may compile."""
        decode = step.decode
        assert decode is not None and decode.slab is not None and decode.positions is not None
        if decode.count == 1:
            padded, padded_cos, padded_sin = _padded_to_two_rows(step, cos, sin, self.pad_slot)
            return self.trace(padded, padded_cos, padded_sin, k_caches, v_caches)[:1]
        return self.graph(  # type: ignore[no-any-return]
            step.input_ids,
            cos,
            sin,
            decode.positions,
            decode.mask_bias,
            step.slot_mapping,
            k_caches,
            v_caches,
            decode.slab.k,
            decode.slab.v,
        )


def _padded_to_two_rows(
    step: llama.StepInputs, cos: torch.Tensor, sin: torch.Tensor, pad_slot: int
) -> tuple[llama.StepInputs, torch.Tensor, torch.Tensor]:
    """A one-row decode step as two rows, the second a copy of the first that writes its K/V
    into ``pad_slot`` of the paged cache and into slab row 1, which no sequence holds (the slab's
    rows in use are exactly the step's rows). Rows never mix in a step (row-wise matmuls and
    norms, attention within a row), so row 0 comes out as it would alone; whatever the pad row
    reads in its slab row stays in its own output, which the caller drops."""
    decode = step.decode
    assert decode is not None and decode.positions is not None and decode.slab is not None
    assert decode.count == 1 and decode.slab.rows >= 2 and pad_slot >= 0
    positions = decode.positions.repeat(2)
    padded = llama.StepInputs(
        input_ids=step.input_ids.repeat(2),
        positions=step.positions.repeat(2),
        slot_mapping=torch.cat([step.slot_mapping, step.slot_mapping.new_full((1,), pad_slot)]),
        decode=llama.DecodeRows(
            count=2,
            span=decode.span,
            mask_bias=decode.mask_bias.repeat(2, 1, 1, 1),
            slab=decode.slab,
            positions=positions,
        ),
        prefill=None,
        sample_index=step.sample_index,
    )
    return padded, cos.repeat(2, 1, 1), sin.repeat(2, 1, 1)


def _mark_dynamic(step: llama.StepInputs, slab: DecodeSlab, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rows and span dynamic: the graph traced here then serves every row count >= 2 and slab size."""
    decode = step.decode
    assert decode is not None and decode.positions is not None
    rows = (step.input_ids, step.positions, step.slot_mapping, decode.positions, decode.mask_bias, cos, sin)
    for t in rows:
        torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.mark_dynamic(decode.mask_bias, 3)
    for t in (*slab.k, *slab.v):
        torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(t, 2)


def memory_to_come(forward: llama.LlamaForward) -> int:
    """Bytes ``compile_decode`` will add to the replica, for the memory plan made before it runs."""
    copy = forward.decode_graph_bytes()
    return copy + COMPILE_STATE_BYTES if copy else 0


def warm_up_step(
    forward: llama.LlamaForward,
    slab: DecodeSlab,
    pad_slot: int,
    rows: int,
    slab_rows: int,
    span: int,
    length: int,
) -> llama.StepInputs:
    """A pure decode step of ``rows`` rows attending over ``span`` positions of ``slab`` (reset to
    ``slab_rows`` x ``length``), every row at the span's last position, writing its K/V into the
    spare padding slot of the paged cache."""
    device = forward.embed.device
    slab.reset(slab_rows, length)
    positions = torch.full((rows,), span - 1, dtype=torch.long, device=device)
    zeros = torch.zeros(rows, 1, 1, span, dtype=forward.embed.dtype, device=device)
    return llama.StepInputs(
        input_ids=torch.zeros(rows, dtype=torch.long, device=device),
        positions=positions,
        slot_mapping=torch.full((rows,), pad_slot, dtype=torch.long, device=device),
        decode=llama.DecodeRows(count=rows, span=span, mask_bias=zeros, slab=slab, positions=positions),
        prefill=None,
        sample_index=torch.arange(rows, device=device),
    )


def compile_decode(
    forward: llama.LlamaForward,
    slab: DecodeSlab,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    pad_slot: int,
    max_rows: int,
    whole_length: bool,
) -> CompiledDecode:
    """Compiles the decode step (before SERVING), calibrates its row buckets, and frees the slab.

    ``whole_length``: the steps attend over each slab row's whole allocated length (the flat
    batch does so in reduced precision on CPU), else over a shorter span of strided rows. The
    two are different graphs (a contiguous slab view lowers differently), so only the one the
    replica's steps use is compiled and timed; steps of the other run eagerly.
    """
    import torch._inductor.config as inductor_config

    started = time.perf_counter()
    compiled = CompiledDecode(forward, whole_length)
    compiled.pad_slot = pad_slot
    max_rows = _rows_that_fit(slab, max_rows)
    if max_rows < 3:
        log.info("decode step not compiled: the decode slab's budget holds fewer than 3 rows")
        return compiled
    # Traced with rows and slab rows different (and neither 0 or 1), and a span shorter than the
    # slab unless it is the whole length: dynamo gives equal sizes one symbol ("duck sizing"),
    # which would tie them together in every later step, and a step breaking the tie would run
    # eagerly.
    trace_span = TRACE_LENGTH if whole_length else TRACE_LENGTH - 8
    with torch.inference_mode(), inductor_config.patch(freezing=True, cpp_wrapper=True):
        step = warm_up_step(forward, slab, pad_slot, max_rows - 1, max_rows, trace_span, TRACE_LENGTH)
        cos, sin = forward.rotary_rows(step.positions)
        _mark_dynamic(step, slab, cos, sin)
        compiled.trace(step, cos, sin, k_caches, v_caches)
    compile_s = time.perf_counter() - started
    # A single row is timed too: it runs the graph padded to two rows (``_padded_to_two_rows``).
    sizes = [1 << k for k in range(0, (max_rows - 1).bit_length() + 1) if 1 << k <= max_rows]
    # Timed where a short batch sits: a 64-position slab, over all of it or its first 48.
    span = WARM_LENGTH if whole_length else WARM_LENGTH - 16
    timings: dict[int, tuple[float, float]] = {}
    with torch.inference_mode(), torch.compiler.set_stance("eager_on_recompile"):
        for rows in sizes:
            # At least two slab rows: a single row's pad row takes the second.
            step = warm_up_step(forward, slab, pad_slot, rows, max(rows, 2), span, WARM_LENGTH)
            cos, sin = forward.rotary_rows(step.positions)
            args = (step, cos, sin, k_caches, v_caches)
            timings[rows] = _time_both(forward.eager_hidden_states, compiled, args)
    slab.release_all(free_memory=True)
    compiled.buckets = faster_buckets(timings, MIN_GAIN)
    log.info(
        "compiled the decode step (%s) in %.1fs; used for row buckets %s of %s (eager/compiled ms: %s)",
        "whole slab length" if whole_length else "span shorter than the slab",
        compile_s,
        sorted(compiled.buckets),
        sizes,
        {r: f"{1e3 * e:.1f}/{1e3 * c:.1f}" for r, (e, c) in timings.items()},
    )
    return compiled


def _rows_that_fit(slab: DecodeSlab, max_rows: int) -> int:
    """The most rows (<= ``max_rows``) whose warm-up slab fits the slab's byte budget."""
    while max_rows >= 3 and slab.bytes_for(max_rows, TRACE_LENGTH) > slab.budget_bytes:
        max_rows //= 2
    return max_rows


def _time_both(eager: Any, compiled: Any, args: tuple[Any, ...]) -> tuple[float, float]:
    """The fastest seconds of the eager and the compiled step, interleaved so drift hits both."""
    eager(*args), compiled(*args)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(CALIBRATION_ROUNDS):
        for fn, out in ((eager, times[0]), (compiled, times[1])):
            started = time.perf_counter()
            fn(*args)
            out.append(time.perf_counter() - started)
    return min(times[0]), min(times[1])


__all__ = ["CompiledDecode", "DecodeStep", "compile_decode", "row_bucket"]
