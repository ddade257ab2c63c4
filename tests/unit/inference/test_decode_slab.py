"""Decode slab: rows hold exactly the paged cache's K/V, survive compaction and growth, respect the budget."""

from __future__ import annotations

import torch

from services.inference.decode_slab import DecodeSlab, SlabRow, length_cover, whole_row_length

LAYERS, KV_HEADS, DIM, BLOCK = 2, 3, 4, 4
NUM_BLOCKS = 128


def caches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Paged caches ([kv_heads, slots, D]) whose every slot holds distinct values."""
    slots = NUM_BLOCKS * BLOCK + 1
    k = [torch.randn(KV_HEADS, slots, DIM) for _ in range(LAYERS)]
    v = [torch.randn(KV_HEADS, slots, DIM) for _ in range(LAYERS)]
    return k, v


def slab(budget: int = 1 << 30, rows: int = 8, whole_rows: bool = False) -> DecodeSlab:
    """``whole_rows``: a slab whose steps read every allocated position (bf16/fp16 on CPU)."""
    return DecodeSlab(
        LAYERS, rows, BLOCK, KV_HEADS, DIM, torch.float32, torch.device("cpu"), budget, whole_rows
    )


def paged(cache: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """[kv_heads, length, D]: a sequence's first ``length`` positions read through its block table."""
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)]
    return cache[:, slots]


def test_rows_hold_each_sequence_past_keys_and_values_in_order() -> None:
    k, v = caches()
    s = slab()
    rows = [SlabRow("a", 6, [5, 9]), SlabRow("b", 3, [2])]
    index = s.prepare(rows, k, v)
    assert index == [0, 1]
    for layer in range(LAYERS):
        assert torch.equal(s.k[layer][0, :, :6], paged(k[layer], [5, 9], 6))
        assert torch.equal(s.v[layer][1, :, :3], paged(v[layer], [2], 3))


def test_a_finished_row_is_replaced_by_the_last_one_with_its_data() -> None:
    k, v = caches()
    s = slab()
    s.prepare([SlabRow("a", 5, [1, 2]), SlabRow("b", 5, [3, 4]), SlabRow("c", 7, [6, 7])], k, v)
    # "a" stops decoding: "c" moves into row 0 and still reads its own positions.
    index = s.prepare([SlabRow("b", 5, [3, 4]), SlabRow("c", 7, [6, 7])], k, v)
    assert index == [1, 0]
    assert s.rows_in_use == 2
    for layer in range(LAYERS):
        assert torch.equal(s.k[layer][0, :, :7], paged(k[layer], [6, 7], 7))
        assert torch.equal(s.k[layer][1, :, :5], paged(k[layer], [3, 4], 5))


def test_a_longer_context_grows_the_slab_and_keeps_the_rows() -> None:
    k, v = caches()
    s = slab()
    table = list(range(20, 40))
    s.prepare([SlabRow("a", 10, table)], k, v)
    assert s.length == 64
    s.prepare([SlabRow("a", 70, table)], k, v)  # 70 positions no longer fit in 64
    assert s.length == 128
    for layer in range(LAYERS):
        assert torch.equal(s.v[layer][0, :, :70], paged(v[layer], table, 70))


def test_over_budget_falls_back_to_gathering_and_frees_the_slab() -> None:
    k, v = caches()
    s = slab(budget=slab().bytes_for(4, 64))
    assert s.prepare([SlabRow("a", 10, [1, 2, 3])], k, v) == [0]
    assert s.prepare([SlabRow("a", 100, list(range(30)))], k, v) is None
    assert (s.rows, s.length) == (0, 0) and s.k == []


def test_the_slab_is_sized_by_the_batch_so_a_few_long_rows_fit_the_budget() -> None:
    k, v = caches()
    # Room for 4 rows of 256 positions: a full slab of 64 rows would hold only 16 each.
    s = slab(budget=slab().bytes_for(4, 256), rows=64)
    table = list(range(10, 62))  # 52 blocks of 4: 208 positions
    rows = [SlabRow(str(i), 200 + i, table) for i in range(3)]
    assert s.prepare(rows, k, v) == [0, 1, 2]
    assert (s.rows, s.length) == (4, 256)
    assert s.k[0].shape == (4, KV_HEADS, 256, DIM)
    for layer in range(LAYERS):
        assert torch.equal(s.k[layer][2, :, :202], paged(k[layer], table, 202))


def test_more_rows_grow_the_slab_and_keep_every_row() -> None:
    k, v = caches()
    s = slab(rows=64)
    first = [SlabRow(str(i), 3, [i]) for i in range(4)]
    s.prepare(first, k, v)
    assert s.rows == 4
    more = [SlabRow(str(i), 4 if i < 4 else 6, [i, 40 + i]) for i in range(9)]
    assert s.prepare(more, k, v) == list(range(9))
    assert (s.rows, s.length) == (16, 64)
    for layer in range(LAYERS):
        for i in range(9):
            assert torch.equal(
                s.v[layer][i, :, : more[i].position], paged(v[layer], [i, 40 + i], more[i].position)
            )


def test_growing_past_the_budget_shrinks_to_the_batch_instead_of_gathering() -> None:
    k, v = caches()
    s = slab(budget=slab().bytes_for(16, 64), rows=64)
    s.prepare([SlabRow(str(i), 3, [i]) for i in range(16)], k, v)
    assert (s.rows, s.length) == (16, 64)
    # Two rows go on to 100 positions: 16 x 128 is over budget, 4 x 128 is not.
    tables = {rid: [int(rid), *range(30, 55)] for rid in ("3", "7")}  # their first block, then more
    index = s.prepare([SlabRow(rid, 100, table) for rid, table in tables.items()], k, v)
    assert index is not None and sorted(index) == [0, 1]
    assert (s.rows, s.length) == (4, 128)
    for layer in range(LAYERS):
        for row, table in zip(index, tables.values(), strict=True):
            assert torch.equal(s.k[layer][row, :, :100], paged(k[layer], table, 100))
    # And back: 16 short rows again, in a slab as short as they are (16 x 128 is still too much).
    assert s.prepare([SlabRow(str(i), 3, [i]) for i in range(16)], k, v) is not None
    assert (s.rows, s.length) == (16, 64)


def test_a_step_with_no_decodes_releases_every_row() -> None:
    k, v = caches()
    s = slab()
    s.prepare([SlabRow("a", 4, [1])], k, v)
    assert s.prepare([], k, v) == []
    assert s.rows_in_use == 0


def test_past_128_positions_the_length_grows_by_128_not_by_doubling() -> None:
    # A slab not read whole (fp32) grows linearly past 128 too: its memory follows the
    # longest row (512 for 260 positions would hold twice what is used).
    assert [length_cover(n) for n in (1, 64, 65, 128, 129, 256, 257, 460, 1500)] == [
        64, 64, 128, 128, 256, 256, 384, 512, 1536,
    ]  # fmt: skip
    k, v = caches()
    s = slab()
    table = list(range(0, 100))  # 400 positions
    s.prepare([SlabRow("a", 200, table)], k, v)
    assert s.length == 256
    s.prepare([SlabRow("a", 259, table)], k, v)  # 260 positions with this step's token
    assert s.length == 384
    for layer in range(LAYERS):
        assert torch.equal(s.k[layer][0, :, :259], paged(k[layer], table, 259))


def whole_row_slab(budget: int = 1 << 30, rows: int = 8) -> DecodeSlab:
    return slab(budget, rows, whole_rows=True)


def test_a_slab_read_whole_grows_in_steps_that_widen_with_its_length() -> None:
    # Every allocated position is read by every step, while a growth copies the rows once:
    # fine steps while rows are short, wider ones as a copy gets dearer.
    assert [whole_row_length(n) for n in (1, 16, 17, 140, 256, 257, 1000, 1025, 1500)] == [
        16, 16, 32, 144, 256, 288, 1024, 1088, 1536,
    ]  # fmt: skip
    k, v = caches()
    s = whole_row_slab()
    table = list(range(0, 60))
    s.prepare([SlabRow("a", 140, table)], k, v)
    assert s.length == 144  # not 256: each of its positions is read by every step
    for layer in range(LAYERS):
        assert torch.equal(s.k[layer][0, :, :140], paged(k[layer], table, 140))


def test_a_growing_slab_copies_its_rows_and_zeroes_what_they_have_not_written() -> None:
    k, v = caches()
    s = whole_row_slab()
    table = list(range(0, 60))
    s.prepare([SlabRow("a", 30, table), SlabRow("b", 8, table)], k, v)
    for layer in range(LAYERS):  # this step's tokens, as the forward writes them
        s.k[layer][0, :, 30] = 7.0
        s.k[layer][1, :, 8] = 7.0
    s.advance([SlabRow("a", 30, table), SlabRow("b", 8, table)])
    # "a" outgrows 32 positions; "c" joins in a row the slab has never written.
    s.prepare([SlabRow("a", 40, table), SlabRow("b", 9, table), SlabRow("c", 5, table)], k, v)
    assert (s.rows, s.length) == (4, 48)
    for layer in range(LAYERS):
        # What the slab held came over (position 30 never was in the paged cache this way) ...
        assert torch.equal(s.k[layer][0, :, 30], torch.full((KV_HEADS, DIM), 7.0))
        assert torch.equal(s.k[layer][0, :, 31:40], paged(k[layer], table, 40)[:, 31:])
        assert torch.equal(s.k[layer][1, :, 8], torch.full((KV_HEADS, DIM), 7.0))
        # ... and every position a row has not written is zero: read and masked, never NaN.
        assert not s.k[layer][0, :, 40:].any() and not s.v[layer][1, :, 9:].any()
        assert not s.k[layer][2, :, 5:].any() and not s.v[layer][2, :, 5:].any()
        assert torch.equal(s.v[layer][2, :, :5], paged(v[layer], table, 5))


def test_a_length_change_sizes_the_rows_by_the_batch_too() -> None:
    # Spare rows are never read, but a resize would copy and hold them.
    k, v = caches()
    s = whole_row_slab(rows=64)
    table = list(range(0, 60))
    s.prepare([SlabRow(str(i), 10, table) for i in range(20)], k, v)
    assert (s.rows, s.length) == (32, 16)
    index = s.prepare([SlabRow(str(i), 20, table) for i in range(3)], k, v)  # 21 positions: 32
    assert index == [0, 1, 2] and (s.rows, s.length) == (4, 32)
    for layer in range(LAYERS):
        for row in range(3):
            assert torch.equal(s.v[layer][row, :, :20], paged(v[layer], table, 20))


def test_a_slab_read_whole_shrinks_to_a_shorter_batch_and_holds_its_rows() -> None:
    k, v = caches()
    s = whole_row_slab()
    long_table, short_tables = list(range(0, 60)), {rid: [40 + i, 50 + i] for i, rid in enumerate("bcd")}
    rows = [SlabRow(rid, 6, table) for rid, table in short_tables.items()]
    s.prepare([SlabRow("a", 230, long_table), *rows], k, v)
    assert s.length == 240
    # The long conversation ends: the short rows would read 240 positions a step for 7.
    index = s.prepare(rows, k, v)
    assert index is not None and s.length == 16
    for layer in range(LAYERS):
        for row, table in zip(index, short_tables.values(), strict=True):
            assert torch.equal(s.k[layer][row, :, :6], paged(k[layer], table, 6))
            assert torch.equal(s.v[layer][row, :, :6], paged(v[layer], table, 6))


def test_a_slab_read_whole_keeps_its_length_while_the_batch_is_near_it() -> None:
    k, v = caches()
    s = whole_row_slab()
    table = list(range(0, 60))
    s.prepare([SlabRow("a", 150, table), SlabRow("b", 130, table)], k, v)
    assert s.length == 160
    # "a" leaves; "b" (131 positions) fits 144, only one step fewer: not worth copying its row.
    s.prepare([SlabRow("b", 130, table)], k, v)
    assert s.length == 160
    # Two steps fewer (112 for 101 positions) is: the slab shrinks.
    s.prepare([SlabRow("c", 100, table)], k, v)
    assert s.length == 112


def test_a_slab_not_read_whole_keeps_its_length_for_shorter_batches() -> None:
    # fp32 reads strided rows over the batch's span: a long slab costs memory, not reads.
    k, v = caches()
    s = slab()
    s.prepare([SlabRow("a", 230, list(range(0, 60)))], k, v)
    s.prepare([SlabRow("b", 6, [1, 2])], k, v)
    assert s.length == 256
