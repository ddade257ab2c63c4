"""Contiguous K/V rows for the decode batch, so decode attention reads the cache in place.

With a paged cache, every decode step gathers each row's blocks into a dense
tensor before attending: for 64 rows that copy costs as much as the attention
itself, every layer, every step. The slab keeps one row per decoding sequence,
``[rows, kv_heads, length, head_dim]`` per layer, with the running rows packed at
the front, so ``slab[:n, :, :span]`` is a view the batched matmuls read directly.

A sequence's row is filled from the paged cache once, when it starts decoding;
each step then writes the new token's K/V to both the paged cache (which stays
the source of truth for prefix reuse and preemption) and the slab. Rows of
sequences that stop decoding are released and the last row moves into the hole.
The slab is a copy, so it has a byte budget. It is sized by the batch: rows in
powers of two, length in powers of two up to ``LENGTH_STEP`` and in multiples of
it beyond, so a few long conversations fit where a full batch of them would not
(8 rows of 1,500 tokens take 0.53 GiB in fp32 SmolLM2, 64 would take 4.2); it only
grows, unless growing would pass the budget while the batch's own size fits. When
even that is over budget the step gathers from the paged cache. Past the step the
length grows linearly, not by doubling: bf16 decode attention reads each row's
whole allocated length (flat_batch.py), so a slab twice the span would be read
twice over; a resize refills the rows, once per ``LENGTH_STEP`` positions.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

# The slab's row count grows in powers of two from MIN_ROWS, its length from MIN_LENGTH in
# powers of two up to LENGTH_STEP and in steps of LENGTH_STEP past it.
MIN_LENGTH = 64
MIN_ROWS = 4
LENGTH_STEP = 128


def power_of_two_cover(n: int, start: int) -> int:
    """The least ``start * 2**k`` that is >= ``n``."""
    size = start
    while size < n:
        size *= 2
    return size


def length_cover(n: int) -> int:
    """The slab length for ``n`` positions: a power of two from MIN_LENGTH up to LENGTH_STEP,
    then the least multiple of LENGTH_STEP that is >= ``n``."""
    if n <= LENGTH_STEP:
        return power_of_two_cover(n, MIN_LENGTH)
    return -(-n // LENGTH_STEP) * LENGTH_STEP


@dataclass(frozen=True)
class SlabRow:
    """One decoding sequence as the slab sees it."""

    request_id: str
    position: int  # where this step's token goes; [0, position) is already in the cache
    block_table: Seq[int]  # the sequence's paged-cache blocks


class DecodeSlab:
    """Per-layer K/V rows for up to ``max_rows`` decoding sequences."""

    def __init__(
        self,
        num_layers: int,
        max_rows: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        budget_bytes: int,
    ) -> None:
        self.num_layers = num_layers
        self.max_rows = max_rows
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.budget_bytes = budget_bytes
        self.rows = 0  # rows allocated (>= rows in use)
        self.length = 0  # positions allocated per row
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._row_of: dict[str, int] = {}
        self._filled: dict[str, int] = {}  # request id -> positions present in its row

    def bytes_for(self, rows: int, length: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * rows * self.num_kv_heads * length * self.head_dim * elem

    @property
    def rows_in_use(self) -> int:
        return len(self._row_of)

    def release_all(self, free_memory: bool = False) -> None:
        self._row_of.clear()
        self._filled.clear()
        if free_memory:
            self.k, self.v, self.rows, self.length = [], [], 0, 0

    def prepare(
        self, rows: Seq[SlabRow], k_caches: Seq[torch.Tensor], v_caches: Seq[torch.Tensor]
    ) -> list[int] | None:
        """Give every row a slab row holding its past K/V; returns each row's index.

        Called every step (with no rows when nothing decodes), so a sequence that
        stopped decoding (finished, aborted, preempted) always loses its row before
        it could decode again. None when the rows do not fit the budget (or the row
        cap): the caller gathers from the paged cache instead, and the slab is
        dropped to free its memory.
        """
        if not rows:
            self.release_all()
            return []
        if len(rows) > self.max_rows:
            self.release_all(free_memory=True)
            return None
        longest = max(r.position for r in rows) + 1
        fitted = (
            min(power_of_two_cover(len(rows), MIN_ROWS), self.max_rows),
            length_cover(longest),
        )
        # Keep what is allocated when it still serves (no reallocation as the batch
        # breathes); shrink to the batch's own size only when growing would pass the budget.
        grown = (max(self.rows, fitted[0]), max(self.length, fitted[1]))
        shape = next((s for s in (grown, fitted) if self.bytes_for(*s) <= self.budget_bytes), None)
        if shape is None:
            self.release_all(free_memory=True)
            return None
        wanted = {r.request_id for r in rows}
        for rid in [rid for rid in self._row_of if rid not in wanted]:
            self._release(rid)
        if shape != (self.rows, self.length):
            self._resize(*shape)
        for r in rows:
            if r.request_id not in self._row_of:
                self._row_of[r.request_id] = len(self._row_of)
                self._filled[r.request_id] = 0
            self._fill(r, k_caches, v_caches)
        return [self._row_of[r.request_id] for r in rows]

    def reset(self, rows: int, length: int) -> None:
        """Drop every row and hold ``rows`` x ``length`` positions (the compiled step's warm-up)."""
        self.release_all()
        self._resize(rows, length)

    def _release(self, request_id: str) -> None:
        row = self._row_of.pop(request_id)
        self._filled.pop(request_id)
        last = len(self._row_of)  # the highest row still in use, if any
        if row == last:
            return
        moved = next(rid for rid, r in self._row_of.items() if r == last)
        used = self._filled[moved]
        for k, v in zip(self.k, self.v, strict=True):
            k[row, :, :used] = k[last, :, :used]
            v[row, :, :used] = v[last, :, :used]
        self._row_of[moved] = row

    def _resize(self, rows: int, length: int) -> None:
        # The old slab goes before the new one is allocated, so the two never take memory
        # at once (the replica's memory plan counts one budget); the rows kept are then
        # filled again from the paged cache, as a row joining the batch is.
        self.k, self.v = [], []
        shape = (rows, self.num_kv_heads, length, self.head_dim)
        # Zeros, not empty: a shorter row's unused positions are read (and masked) with the
        # batch's span, and garbage there could be NaN, which masking does not undo.
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self._filled = dict.fromkeys(self._filled, 0)
        self.rows, self.length = rows, length

    def _fill(self, row: SlabRow, k_caches: Seq[torch.Tensor], v_caches: Seq[torch.Tensor]) -> None:
        done = self._filled[row.request_id]
        if done >= row.position:
            return
        index = self._row_of[row.request_id]
        table, size = row.block_table, self.block_size
        slots = torch.tensor(
            [table[p // size] * size + p % size for p in range(done, row.position)],
            dtype=torch.long,
            device=self.device,
        )
        for k, v, k_cache, v_cache in zip(self.k, self.v, k_caches, v_caches, strict=True):
            k[index, :, done : row.position] = k_cache.index_select(1, slots)
            v[index, :, done : row.position] = v_cache.index_select(1, slots)
        self._filled[row.request_id] = row.position

    def advance(self, rows: Seq[SlabRow]) -> None:
        """Record that the forward wrote each row's token at its position."""
        for r in rows:
            self._filled[r.request_id] = r.position + 1
