"""BlockManager: allocation, prefix reuse by chained hash, refcounts and LRU eviction (no torch, no model)."""

from __future__ import annotations

from services.common.kv_blocks import block_hashes, salt_seed
from services.inference.block_manager import BlockManager
from services.inference.sampling import SamplingParams
from services.inference.sequence import Sequence

BS = 4


def seq(rid: str, tokens: list[int], cache_salt: str = "") -> Sequence:
    return Sequence(
        request_id=rid,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=SamplingParams(),
        cache_salt=cache_salt,
    )


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """Allocate and mark the whole sequence computed, as after its prefill."""
    assert bm.allocate(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)
    return s


def test_allocation_rounds_up_to_whole_blocks_and_refuses_without_taking_anything() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = seq("a", list(range(9)))
    assert bm.allocate(a, 9)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 0
    b = seq("b", [1])
    assert bm.allocate(b, 1) is False
    assert b.block_table == [] and bm.usage().used == 3


def test_growing_by_one_token_takes_a_block_only_at_block_boundaries() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = computed(bm, seq("a", list(range(4))))
    assert len(a.block_table) == 1
    a.token_ids.append(99)
    assert bm.allocate(a, 1)
    assert len(a.block_table) == 2


def test_a_second_sequence_with_the_same_prefix_reuses_its_full_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prefix = list(range(100, 108))  # two full blocks
    a = computed(bm, seq("a", [*prefix, 1, 2]))
    b = seq("b", [*prefix, 7, 8, 9])

    cached = bm.match_prefix(b)

    assert cached == 8
    assert b.block_table == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2


def test_prefix_match_stops_at_the_first_different_block_and_never_covers_the_last_token() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    computed(bm, seq("a", list(range(12))))
    diverging = seq("b", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11])
    assert bm.match_prefix(diverging) == 4
    identical = seq("c", list(range(12)))
    # 12 tokens = 3 full blocks, but the last token must be computed to get logits.
    assert bm.match_prefix(identical) == 8


def test_chained_hash_does_not_match_an_equal_block_after_a_different_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    computed(bm, seq("a", [1, 1, 1, 1, 5, 6, 7, 8, 0]))
    other = seq("b", [2, 2, 2, 2, 5, 6, 7, 8, 0])
    assert bm.match_prefix(other) == 0


def test_freed_hashed_blocks_stay_cached_until_space_is_needed_then_lru_goes_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    old = computed(bm, seq("old", [1, 2, 3, 4, 0]))  # 2 blocks, first one full and hashed
    bm.free(old)
    new = computed(bm, seq("new", [5, 6, 7, 8, 0]))
    bm.free(new)
    usage = bm.usage()
    assert usage.used == 0 and usage.cached == 2 and bm.num_free_blocks == 4

    # Needs all 4 blocks: the 2 plain free ones, then evicts the least recently used cached block ("old").
    big = seq("big", list(range(50, 63)))
    assert bm.allocate(big, 13)
    assert bm.usage().cached == 0
    assert bm.match_prefix(seq("old-again", [1, 2, 3, 4, 0])) == 0


def test_eviction_order_follows_last_use() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    first = computed(bm, seq("first", [1, 2, 3, 4]))
    second = computed(bm, seq("second", [5, 6, 7, 8]))
    bm.free(first)
    bm.free(second)
    # Reuse "first" so it becomes the most recently used cached block.
    again = seq("again", [1, 2, 3, 4, 9])
    assert bm.match_prefix(again) == 4
    bm.free(again)
    filler = seq("filler", list(range(20, 28)))
    assert bm.allocate(filler, 8)  # one free block + evicts one cached: must be "second"
    assert bm.match_prefix(seq("p", [1, 2, 3, 4, 0])) == 4
    assert bm.match_prefix(seq("q", [5, 6, 7, 8, 0])) == 0


def test_shared_block_is_only_released_when_its_last_holder_frees_it() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = computed(bm, seq("a", [1, 2, 3, 4, 5]))
    b = seq("b", [1, 2, 3, 4, 6])
    bm.match_prefix(b)
    shared = a.block_table[0]
    bm.free(a)
    assert bm.blocks[shared].ref_count == 1
    assert bm.usage().used == 1
    bm.free(b)
    assert bm.blocks[shared].ref_count == 0 and bm.usage().used == 0 and bm.usage().cached == 1


def test_cached_blocks_are_reused_only_by_a_sequence_of_the_same_salt() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(13))  # three full blocks and one token
    computed(bm, seq("alice-1", prompt, cache_salt="alice"))
    assert bm.match_prefix(seq("bob", prompt, cache_salt="bob")) == 0
    assert bm.match_prefix(seq("plain", prompt)) == 0
    assert bm.match_prefix(seq("alice-2", prompt, cache_salt="alice")) == 12
    # The blocks it offers are under the salted chain, as the router computes it.
    stored = {b.block_hash for b in bm.blocks if b.block_hash is not None}
    assert stored == set(block_hashes(prompt, BS, salt_seed("alice")))
