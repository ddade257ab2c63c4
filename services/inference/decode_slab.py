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
length grows linearly, not by doubling, so memory follows the longest row.

When steps read every row's whole allocated length (``whole_rows``, bf16/fp16 on
CPU), every allocated position the batch does not use is attention work for
nothing, so the length follows the batch both ways, in fine steps
(``whole_row_length``): it grows as the longest row does and shrinks once that row is
well short of it. Without that a slab grown by one long conversation made every later
short batch take the strided path (flat_batch.py) and, under ``--compile``, the eager
forward: measured 2026-12-05 in bf16 at 64 rows, 92 ms a step instead of 68.

A resize keeps what the rows hold: each layer's new tensor takes the old one's rows
by one copy, so only positions the slab never held come from the paged cache. With
the refill through the block tables, a step that grew a 48-row bf16 slab took 50–190 ms
more than its neighbours; with the copy, 20–50 (measured 2026-12-05 on the serving
workload, in-process), and that cost is what kept the steps coarse.
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
#: With ``whole_rows`` the length is a multiple of a step that widens with it: each unused
#: position is read by every step (half a step of waste on average), while a growth copies
#: every row once, which costs about 0.6-0.8 of one step's attention over the same positions
#: alone and up to 2 inside a running batch (measured 2026-12-05 in bf16, 16-64 rows, 64-512
#: positions). At length L a step of S then costs about S/2 + c L/S positions' reads a step,
#: least at S = sqrt(2 c L): for c = 0.7-2, 11-18 at L = 80, 19-32 at 256, 37-63 at 1,000.
#: These steps sit in those ranges.
WHOLE_ROW_STEPS = ((256, 16), (1024, 32))
WHOLE_ROW_LAST_STEP = 64
#: With ``whole_rows`` the length shrinks to the batch's once that frees at least
#: ``WHOLE_ROW_SHRINK_STEPS`` of the batch's steps a row, or the batch would read less than half
#: of each row: hysteresis, so a batch that breathes around one length does not copy its rows
#: every few steps.
WHOLE_ROW_SHRINK_STEPS = 2


def power_of_two_cover(n: int, start: int) -> int:
    """The least ``start * 2**k`` that is >= ``n``."""
    size = start
    while size < n:
        size *= 2
    return size


def length_cover(n: int, step: int = LENGTH_STEP) -> int:
    """The slab length for ``n`` positions: a power of two from MIN_LENGTH up to
    max(MIN_LENGTH, ``step``), then the least multiple of ``step`` that is >= ``n``."""
    if n <= max(MIN_LENGTH, step):
        return power_of_two_cover(n, MIN_LENGTH)
    return -(-n // step) * step


def whole_row_step(n: int) -> int:
    """The length step of a slab read whole, around ``n`` positions (``WHOLE_ROW_STEPS``)."""
    return next((step for limit, step in WHOLE_ROW_STEPS if n <= limit), WHOLE_ROW_LAST_STEP)


def whole_row_length(n: int) -> int:
    """The length of a slab read whole for ``n`` positions: the least multiple of its step >= ``n``."""
    step = whole_row_step(n)
    return -(-max(n, 1) // step) * step


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
        whole_rows: bool = False,
    ) -> None:
        """``whole_rows``: decode steps read every allocated position of a row (see the module)."""
        self.num_layers = num_layers
        self.whole_rows = whole_rows
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
            whole_row_length(longest) if self.whole_rows else length_cover(longest),
        )
        # Keep what is allocated when it still serves (no reallocation as the batch
        # breathes); shrink to the batch's own size only when growing would pass the budget,
        # or, for a slab read whole, when its length is well past what the batch reads.
        length = max(self.length, fitted[1])
        slack = WHOLE_ROW_SHRINK_STEPS * whole_row_step(fitted[1])
        if self.whole_rows and (fitted[1] + slack <= self.length or 2 * longest < self.length):
            length = fitted[1]
        # A length change reallocates anyway: the rows then follow the batch too (the graph reads
        # only the rows in use, so spare rows cost memory and the copy, not reads).
        grown = (max(self.rows, fitted[0]) if length == self.length else fitted[0], length)
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
                row = self._row_of[r.request_id] = len(self._row_of)
                self._filled[r.request_id] = 0
                # Its positions past the ones _fill copies are read (masked) until written:
                # zeros, as a row's memory may never have been written (``_resize``).
                for layer in (*self.k, *self.v):
                    layer[row, :, r.position :].zero_()
        self._fill(rows, k_caches, v_caches)
        return [self._row_of[r.request_id] for r in rows]

    def reset(self, rows: int, length: int) -> None:
        """Drop every row and hold ``rows`` x ``length`` positions (the compiled step's warm-up)."""
        self.release_all()
        self._resize(rows, length)
        for layer in (*self.k, *self.v):
            layer.zero_()

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
        """Reallocate every layer at ``rows`` x ``length``, keeping what the rows in use hold.

        Only the rows in use are written here (their data copied, their new positions zeroed);
        a row that joins later is zeroed past its data as it joins (``prepare``). So the rest
        of the new memory is never touched until used: no time spent zeroing it, and no pages
        resident for rows the batch does not have.
        """
        shape = (rows, self.num_kv_heads, length, self.head_dim)
        # The rows in use are packed at the front (``_release``) and fit the new shape
        # (``prepare`` sizes it by them); their positions past the new length are not needed.
        keep_rows, keep_length = min(self.rows_in_use, rows), min(length, self.length)
        for layers in (self.k, self.v):
            if len(layers) != self.num_layers:  # nothing allocated yet (or freed)
                layers[:] = [torch.empty(0, dtype=self.dtype, device=self.device)] * self.num_layers
            for i, old in enumerate(layers):
                # Layer by layer, the old tensor going as its successor is filled: the two
                # slabs never take memory at once beyond one layer (the replica's memory plan
                # counts one budget).
                new = torch.empty(shape, dtype=self.dtype, device=self.device)
                if keep_rows:
                    new[:keep_rows, :, :keep_length] = old[:keep_rows, :, :keep_length]
                    # Zeros, not garbage: a shorter row's unused positions are read (and masked)
                    # with the batch's span, and garbage there could be NaN, which masking does
                    # not undo.
                    new[:keep_rows, :, keep_length:].zero_()
                layers[i] = new
                del old
        self._filled = {rid: min(done, keep_length) for rid, done in self._filled.items()}
        self.rows, self.length = rows, length

    def _fill(self, rows: Seq[SlabRow], k_caches: Seq[torch.Tensor], v_caches: Seq[torch.Tensor]) -> None:
        """Copy every row's missing positions from the paged cache, all rows together: per layer
        and KV head one gather of [positions, D] and one scatter into the slab seen as
        [rows * heads * length, D]. Row by row, a refill of 64 rows x 96 positions was ~4,000
        small copies and ~70 ms in bf16 here; this way ~40 ms, which is about what moving those
        bytes through this VM's memory costs (and why the length does not grow in small steps)."""
        slots: list[int] = []
        rows_at: list[int] = []
        positions: list[int] = []
        size = self.block_size
        for r in rows:
            done = self._filled[r.request_id]
            if done >= r.position:
                continue
            table = r.block_table
            slots.extend(table[p // size] * size + p % size for p in range(done, r.position))
            rows_at.extend([self._row_of[r.request_id]] * (r.position - done))
            positions.extend(range(done, r.position))
            self._filled[r.request_id] = r.position
        if not slots:
            return
        device, heads = self.device, self.num_kv_heads
        slot_t = torch.tensor(slots, dtype=torch.long, device=device)
        row_t = torch.tensor(rows_at, dtype=torch.long, device=device)
        position_t = torch.tensor(positions, dtype=torch.long, device=device)
        head_t = torch.arange(heads, device=device)
        # [heads, N]: where (row, head, position) sits in the slab flattened to [-1, D].
        where = (row_t[None, :] * heads + head_t[:, None]) * self.length + position_t[None, :]
        for slab_k, slab_v, k_cache, v_cache in zip(self.k, self.v, k_caches, v_caches, strict=True):
            for slab_layer, cache in ((slab_k, k_cache), (slab_v, v_cache)):
                flat = slab_layer.view(-1, self.head_dim)
                # Per head: a gather along dim 1 of [heads, slots, D] is ~10x slower on CPU.
                for h in range(heads):
                    flat.index_copy_(0, where[h], cache[h].index_select(0, slot_t))

    def advance(self, rows: Seq[SlabRow]) -> None:
        """Record that the forward wrote each row's token at its position."""
        for r in rows:
            self._filled[r.request_id] = r.position + 1
