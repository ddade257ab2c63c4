"""The prefix index's bound on a replica's precise blocks: what a replica can hold, and what
happens to an entry whose events claim more (dropped whole, placement falls back to what this
router sent)."""

from __future__ import annotations

import pytest

from services.router.placement.prefix_index import MAX_PRECISE_BLOCKS, IndexOverflow, PrefixIndex

CHAIN = [0xFFFF_FFFF_FFFF_FF00 + i for i in range(8)]


def test_the_bound_is_the_replicas_capacity_capped_else_a_constant() -> None:
    index = PrefixIndex()
    assert index.precise_limit(160) == 160  # what its load report says it holds in all
    assert index.precise_limit(0) == MAX_PRECISE_BLOCKS  # not known yet: the constant
    # A capacity no accelerator has (a hostile or broken report) does not lift the bound.
    assert index.precise_limit(10**12) == MAX_PRECISE_BLOCKS
    assert PrefixIndex(max_precise_blocks=50).precise_limit(0) == 50
    with pytest.raises(ValueError):
        PrefixIndex(max_precise_blocks=0)


def test_a_snapshot_over_the_replicas_capacity_is_refused_and_nothing_of_it_claimed() -> None:
    index = PrefixIndex()
    index.apply_snapshot("r1", "i", 1, 16, CHAIN[:4], capacity=64)
    with pytest.raises(IndexOverflow) as caught:
        index.apply_snapshot("r1", "i", 2, 16, [*CHAIN, *range(100)], capacity=64)
    assert (caught.value.replica, caught.value.blocks, caught.value.limit) == ("r1", 108, 64)
    # Wrong about some block, and nothing says which: none is claimed, the old entry included.
    assert not index.is_precise("r1") and index.sequence("r1") is None
    assert index.cached_prefix_blocks("r1", CHAIN) == 0
    assert index.block_count("r1") == 0


def test_deltas_past_the_capacity_drop_the_entry_and_placement_falls_back_to_what_was_sent() -> None:
    index = PrefixIndex(clock=lambda: 0.0)
    index.apply_snapshot("r1", "i", 1, 16, range(60), capacity=64)
    assert index.apply_delta("r1", "i", 2, stored=CHAIN[:4], evicted=[], capacity=64)  # 64: full
    # Evicted first: a full cache that evicts as it stores stays within the bound.
    assert index.apply_delta("r1", "i", 3, stored=CHAIN[4:6], evicted=[0, 1], capacity=64)
    assert index.block_count("r1") == 64
    assert index.cached_prefix_blocks("r1", CHAIN) == 6
    with pytest.raises(IndexOverflow):
        index.apply_delta("r1", "i", 4, stored=CHAIN[6:], evicted=[], capacity=64)  # 66 > 64
    assert not index.is_precise("r1") and index.block_count("r1") == 0
    assert index.cached_prefix_blocks("r1", CHAIN) == 0  # its events' blocks are claimed no more
    # The approximate mode from now on: only what this router sent there, for its TTL.
    index.record_sent("r1", 16, CHAIN[:2])
    assert index.cached_prefix_blocks("r1", CHAIN) == 2
    # Later deltas of that stream find no entry: the caller resubscribes for a snapshot.
    assert not index.apply_delta("r1", "i", 5, stored=[], evicted=[], capacity=64)


def test_a_replica_streaming_ever_more_stored_blocks_is_held_to_the_bound() -> None:
    """Each delta message is bounded (gRPC's 4 MiB), their sum was not: a replica that reported
    a million stored blocks in a few hundred deltas grew the router by ~70 MiB, and on."""
    index = PrefixIndex(max_precise_blocks=5_000)  # the constant (2**20), smaller for the test
    index.apply_snapshot("r1", "i", 0, 16, [])  # no capacity known (no load report yet)
    sequence, stored = 0, 0
    with pytest.raises(IndexOverflow):
        while True:
            sequence += 1
            index.apply_delta("r1", "i", sequence, stored=range(stored, stored + 1_000), evicted=[])
            stored += 1_000
            assert index.block_count("r1") <= 5_000
    assert sequence == 6 and index.block_count("r1") == 0
    assert index.replicas() == []  # the memory went with the entry


def test_a_capacity_learned_after_the_snapshot_bounds_the_next_delta() -> None:
    index = PrefixIndex()
    index.apply_snapshot("r1", "i", 1, 16, range(100))  # before the first load report
    with pytest.raises(IndexOverflow):
        index.apply_delta("r1", "i", 2, stored=[], evicted=[], capacity=80)  # it holds 80 in all
    assert not index.is_precise("r1")
