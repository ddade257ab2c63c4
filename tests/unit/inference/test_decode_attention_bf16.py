"""Decode attention over the slab in bf16: it reads each row's whole allocated length (so oneDNN's
batched matmul needs no copy) and still attends to each row's own positions only, as in fp32."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from services.inference import llama
from services.inference.decode_slab import DecodeSlab, SlabRow
from services.inference.flat_batch import FlatBatchBuilder

HEADS, KV_HEADS, DIM, BLOCK, BLOCKS = 6, 2, 8, 4, 64
POSITIONS = (5, 13, 40)  # each row's new token; [0, position) is in the cache
TABLE = 16  # blocks per row: 64 positions


def slab_and_caches(
    dtype: torch.dtype, whole_rows: bool = False
) -> tuple[DecodeSlab, list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    k = [torch.randn(KV_HEADS, BLOCKS * BLOCK + 1, DIM).to(dtype)]
    v = [torch.randn(KV_HEADS, BLOCKS * BLOCK + 1, DIM).to(dtype)]
    slab = DecodeSlab(1, 4, BLOCK, KV_HEADS, DIM, dtype, torch.device("cpu"), 1 << 30, whole_rows)
    rows = [SlabRow(f"r{i}", p, list(range(i * TABLE, (i + 1) * TABLE))) for i, p in enumerate(POSITIONS)]
    assert slab.prepare(rows, k, v) == [0, 1, 2]
    for i, p in enumerate(POSITIONS):  # the step's own token, as the forward writes it
        slab.k[0][i, :, p] = torch.randn(KV_HEADS, DIM).to(dtype)
        slab.v[0][i, :, p] = torch.randn(KV_HEADS, DIM).to(dtype)
    return slab, k, v


def decode_rows(dtype: torch.dtype, slab: DecodeSlab, k: list[torch.Tensor], v: list[torch.Tensor]) -> Any:
    builder = FlatBatchBuilder(BLOCK, torch.device("cpu"), dtype, k, v, slab)
    decodes: Any = [SimpleNamespace(start=p) for p in POSITIONS]
    return builder._slab_decode_rows(decodes, torch.tensor(POSITIONS))


def attention(rows: llama.DecodeRows, q: torch.Tensor) -> torch.Tensor:
    forward = object.__new__(llama.LlamaForward)  # the attention reads these fields only
    forward.num_heads, forward.num_kv_heads, forward.head_dim = HEADS, KV_HEADS, DIM
    forward.group, forward.scale, forward.scratch = HEADS // KV_HEADS, DIM**-0.5, llama.Scratch()
    return forward._decode_attention(q, 0, torch.empty(0), torch.empty(0), rows)


def reference(slab: DecodeSlab, q: torch.Tensor) -> torch.Tensor:
    """Each row attends to its positions [0, position] alone, in fp32."""
    out = []
    for i, p in enumerate(POSITIONS):
        keys = slab.k[0][i, :, : p + 1].float().repeat_interleave(HEADS // KV_HEADS, 0)
        values = slab.v[0][i, :, : p + 1].float().repeat_interleave(HEADS // KV_HEADS, 0)
        scores = (q[i].float()[:, None, :] @ keys.transpose(-1, -2)).squeeze(1) * DIM**-0.5
        out.append((scores.softmax(-1)[:, None, :] @ values).squeeze(1))
    return torch.stack(out)


def test_bf16_reads_the_whole_slab_length_and_attends_to_each_rows_positions_alone() -> None:
    slab, k, v = slab_and_caches(torch.bfloat16)
    rows = decode_rows(torch.bfloat16, slab, k, v)
    assert rows.span == slab.length == 64 > max(POSITIONS) + 1
    keys = slab.k[0][: rows.count, :, : rows.span]
    assert keys.is_contiguous()  # what lets oneDNN's bf16 matmul read it without a copy
    # Whatever lies past a row's position (zeros, or a moved row's old keys) is masked out.
    slab.k[0][0, :, POSITIONS[0] + 1 :] = 50.0
    q = torch.randn(len(POSITIONS), HEADS, DIM).to(torch.bfloat16)
    got = attention(rows, q).float()
    torch.testing.assert_close(got, reference(slab, q), atol=3e-2, rtol=3e-2)


def test_fp32_keeps_the_batchs_own_span() -> None:
    slab, k, v = slab_and_caches(torch.float32)
    rows = decode_rows(torch.float32, slab, k, v)
    assert rows.span == max(POSITIONS) + 1 < slab.length
    q = torch.randn(len(POSITIONS), HEADS, DIM)
    torch.testing.assert_close(attention(rows, q), reference(slab, q), atol=1e-5, rtol=1e-5)


def test_a_slab_left_long_by_an_earlier_batch_shrinks_and_is_read_whole() -> None:
    # As the model runner builds it in bf16 on CPU: its length follows the batch down too.
    slab, k, v = slab_and_caches(torch.bfloat16, whole_rows=True)
    slab._resize(slab.rows, 256)  # as an earlier batch of 200-odd positions left it
    rows = [SlabRow(f"r{i}", p, list(range(i * TABLE, (i + 1) * TABLE))) for i, p in enumerate(POSITIONS)]
    assert slab.prepare(rows, k, v) == [0, 1, 2] and slab.length == 48  # 41 positions, in steps of 16
    for i, p in enumerate(POSITIONS):  # the step's own token, as the forward writes it
        slab.k[0][i, :, p] = torch.randn(KV_HEADS, DIM).to(torch.bfloat16)
        slab.v[0][i, :, p] = torch.randn(KV_HEADS, DIM).to(torch.bfloat16)
    decode = decode_rows(torch.bfloat16, slab, k, v)
    assert decode.span == slab.length == 48  # whole rows: contiguous, and the compiled graph's case
    q = torch.randn(len(POSITIONS), HEADS, DIM).to(torch.bfloat16)
    torch.testing.assert_close(attention(decode, q).float(), reference(slab, q), atol=3e-2, rtol=3e-2)


def test_a_slab_more_than_twice_the_batchs_span_is_read_over_the_span_alone() -> None:
    # A slab that keeps its length (here one not built to shrink; in the runner, a batch of
    # rows under 32 positions in a 64-position slab) is read over the span, strided.
    slab, k, v = slab_and_caches(torch.bfloat16)
    slab._resize(slab.rows, 256)  # as an earlier batch of 200-odd positions left it
    rows = [SlabRow(f"r{i}", p, list(range(i * TABLE, (i + 1) * TABLE))) for i, p in enumerate(POSITIONS)]
    assert slab.prepare(rows, k, v) == [0, 1, 2] and slab.length == 256
    decode = decode_rows(torch.bfloat16, slab, k, v)
    assert decode.span == max(POSITIONS) + 1  # 41 positions, not 256
    q = torch.randn(len(POSITIONS), HEADS, DIM).to(torch.bfloat16)
    torch.testing.assert_close(attention(decode, q).float(), reference(slab, q), atol=3e-2, rtol=3e-2)
