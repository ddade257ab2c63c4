"""The prefix index without servers: snapshots and deltas by sequence, resync on a gap or restart,
the approximate mode's expiry, longest-prefix lookups."""

from __future__ import annotations

from services.router.placement.prefix_index import PrefixIndex


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


CHAIN = [0xFFFF_FFFF_FFFF_FFF0 + i for i in range(8)]  # unsigned 64-bit, near the top of the range


def test_a_snapshot_then_deltas_in_sequence_give_the_longest_cached_prefix() -> None:
    index = PrefixIndex()
    index.apply_snapshot("r1", "inc-a", 10, 16, CHAIN[:3])
    assert index.cached_prefix_blocks("r1", CHAIN) == 3
    assert index.apply_delta("r1", "inc-a", 11, stored=CHAIN[3:5], evicted=[])
    assert index.cached_prefix_blocks("r1", CHAIN) == 5
    # Evicting a middle block cuts the prefix there, even though later blocks are still held.
    assert index.apply_delta("r1", "inc-a", 12, stored=[], evicted=[CHAIN[1]])
    assert index.cached_prefix_blocks("r1", CHAIN) == 1
    assert index.block_count("r1") == 4
    assert index.cached_prefix_blocks("r1", [123, *CHAIN]) == 0  # another prompt's first block
    assert index.cached_prefix_blocks("elsewhere", CHAIN) == 0


def test_a_gap_in_sequence_numbers_marks_the_entry_stale_until_a_snapshot() -> None:
    index = PrefixIndex()
    index.apply_snapshot("r1", "inc-a", 10, 16, CHAIN[:4])
    assert not index.apply_delta("r1", "inc-a", 12, stored=CHAIN[4:6], evicted=[])  # 11 went missing
    assert not index.is_precise("r1")
    assert index.cached_prefix_blocks("r1", CHAIN) == 0  # stale: not used for scoring
    # Later deltas are refused too until the caller resyncs.
    assert not index.apply_delta("r1", "inc-a", 13, stored=[], evicted=[])
    index.apply_snapshot("r1", "inc-a", 13, 16, CHAIN[:6])
    assert index.is_precise("r1")
    assert index.cached_prefix_blocks("r1", CHAIN) == 6
    assert index.apply_delta("r1", "inc-a", 14, stored=CHAIN[6:], evicted=[])
    assert index.cached_prefix_blocks("r1", CHAIN) == 8


def test_a_repeated_or_old_sequence_number_is_out_of_order() -> None:
    index = PrefixIndex()
    index.apply_snapshot("r1", "inc-a", 5, 16, CHAIN[:2])
    assert index.apply_delta("r1", "inc-a", 6, stored=[CHAIN[2]], evicted=[])
    assert not index.apply_delta("r1", "inc-a", 6, stored=[CHAIN[3]], evicted=[])
    assert index.cached_prefix_blocks("r1", CHAIN) == 0


def test_a_new_incarnation_is_a_restart_whose_old_blocks_count_for_nothing() -> None:
    index = PrefixIndex()
    index.apply_snapshot("r1", "inc-a", 10, 16, CHAIN)
    # The replica restarted: its numbering starts over, and so does its cache.
    assert not index.apply_delta("r1", "inc-b", 1, stored=[CHAIN[0]], evicted=[])
    assert index.cached_prefix_blocks("r1", CHAIN) == 0
    index.apply_snapshot("r1", "inc-b", 1, 16, [CHAIN[0]])
    assert index.cached_prefix_blocks("r1", CHAIN) == 1


def test_a_delta_before_any_snapshot_asks_for_one() -> None:
    index = PrefixIndex()
    assert not index.apply_delta("r1", "inc-a", 1, stored=CHAIN, evicted=[])
    assert index.cached_prefix_blocks("r1", CHAIN) == 0


def test_the_approximate_mode_remembers_what_was_sent_and_expires() -> None:
    clock = FakeClock()
    index = PrefixIndex(clock=clock, approximate_ttl_s=60.0)
    index.record_sent("r1", 16, CHAIN[:5])
    assert index.cached_prefix_blocks("r1", CHAIN) == 5
    assert index.block_count("r1") == 5
    clock.now += 30
    index.record_sent("r1", 16, CHAIN[:2])  # the first two refreshed, the rest keep their expiry
    clock.now += 31
    assert index.cached_prefix_blocks("r1", CHAIN) == 2
    assert index.block_count("r1") == 2
    clock.now += 30
    assert index.cached_prefix_blocks("r1", CHAIN) == 0
    assert index.block_count("r1") == 0


def test_a_hot_prefix_sent_again_and_again_is_kept_once_per_block() -> None:
    """What a send holds is one expiry per block, whatever the rate: a log of every send held
    128 MiB for one hot prefix sent 200 times a second (its TTL times the rate)."""
    clock = FakeClock()
    index = PrefixIndex(clock=clock, approximate_ttl_s=60.0)
    index.apply_snapshot("r1", "inc-a", 1, 16, [])
    for _ in range(10_000):
        index.record_sent("r1", 16, CHAIN)  # never stored: it stays pending
        index.record_sent("r2", 16, CHAIN)  # no events from r2: its approximate entry
        clock.now += 0.005
    pending, approximate = index._precise["r1"].pending, index._approximate["r2"][16]
    assert pending is not None
    assert len(pending.expires) == len(approximate.expires) == len(CHAIN)
    assert vars(pending).keys() == {"block_size", "expires"}  # nothing else grows with the sends
    assert index.cached_prefix_blocks("r2", CHAIN) == len(CHAIN)
    clock.now += 61
    assert index.cached_prefix_blocks("r2", CHAIN) == 0


def test_a_fresh_precise_entry_wins_over_the_approximate_one_and_a_stale_one_falls_back() -> None:
    index = PrefixIndex(clock=FakeClock())
    index.record_sent("r1", 16, CHAIN[:6])
    index.apply_snapshot("r1", "inc-a", 1, 16, CHAIN[:2])  # the replica evicted what the router sent
    assert index.cached_prefix_blocks("r1", CHAIN) == 2
    assert not index.apply_delta("r1", "inc-a", 9, stored=[], evicted=[])  # the stream lost events
    assert index.cached_prefix_blocks("r1", CHAIN) == 6  # what this router sent, until a snapshot


def test_forget_empties_both_modes_and_another_block_size_matches_nothing() -> None:
    index = PrefixIndex(clock=FakeClock())
    index.apply_snapshot("r1", "inc-a", 1, 16, CHAIN)
    index.record_sent("r2", 16, CHAIN)
    assert index.cached_prefix_blocks("r1", CHAIN, block_size=32) == 0
    assert index.cached_prefix_blocks("r2", CHAIN, block_size=32) == 0
    assert index.cached_prefix_blocks("r1", CHAIN, block_size=16) == 8
    index.forget("r1")
    index.forget("r2")
    assert index.replicas() == []
    assert index.cached_prefix_blocks("r1", CHAIN) == index.cached_prefix_blocks("r2", CHAIN) == 0


def test_blocks_sent_to_a_replica_with_events_count_as_held_until_its_events_say_otherwise() -> None:
    clock = FakeClock()
    index = PrefixIndex(clock=clock, approximate_ttl_s=60.0)
    index.apply_snapshot("r1", "inc-a", 1, 16, CHAIN[:2])
    # Sent, queued there, not prefilled yet: the next request of the prompt finds it on its way.
    index.record_sent("r1", 16, CHAIN[:6])
    assert index.cached_prefix_blocks("r1", CHAIN) == 6
    assert index.block_count("r1") == 2  # the index's size is what the replica reports
    # Stored: from now on the events rule, so an eviction takes the blocks away.
    assert index.apply_delta("r1", "inc-a", 2, stored=CHAIN[2:6], evicted=[])
    assert index.cached_prefix_blocks("r1", CHAIN) == 6
    assert index.apply_delta("r1", "inc-a", 3, stored=[], evicted=CHAIN[3:6])
    assert index.cached_prefix_blocks("r1", CHAIN) == 3
    # Sent again and never stored (the request failed): it counts only for the TTL.
    index.record_sent("r1", 16, CHAIN)
    assert index.cached_prefix_blocks("r1", CHAIN) == 8
    clock.now += 61
    assert index.cached_prefix_blocks("r1", CHAIN) == 3
    # Another replica never sent to holds none of it.
    index.apply_snapshot("r2", "inc-b", 1, 16, [])
    assert index.cached_prefix_blocks("r2", CHAIN) == 0


def test_a_pending_block_between_held_ones_continues_the_prefix() -> None:
    index = PrefixIndex(clock=FakeClock())
    index.apply_snapshot("r1", "inc-a", 1, 16, CHAIN[:2] + CHAIN[4:6])
    index.record_sent("r1", 16, CHAIN[:4])  # blocks 2 and 3 are on their way
    assert index.cached_prefix_blocks("r1", CHAIN) == 6
    index.forget("r1")  # the stream broke: nothing is known, pending included
    assert index.cached_prefix_blocks("r1", CHAIN) == 0


def test_another_prompts_prefill_queued_on_a_replica_counts_until_stored_or_expired() -> None:
    clock = FakeClock()
    index = PrefixIndex(clock=clock, approximate_ttl_s=60.0)
    other = [0x1234_0000 + i for i in range(5)]  # another prompt's chain
    index.apply_snapshot("r1", "inc-a", 1, 16, CHAIN[:2])
    index.record_sent("r1", 16, CHAIN[:6])  # 4 blocks on their way: 2 were held already
    # Another prompt waits behind those 4 blocks' prefill; this prompt's own request does not:
    # they are its own prefix, on its way.
    assert index.pending_tokens_outside("r1", other) == 4 * 16
    assert index.pending_tokens_outside("r1", CHAIN) == 0
    assert index.pending_tokens_outside("r1", CHAIN[:3]) == 3 * 16  # it shares blocks 0-2 only
    # Prefilled in two chunks: each stored event takes its blocks off the queue.
    assert index.apply_delta("r1", "inc-a", 2, stored=CHAIN[2:4], evicted=[])
    assert index.pending_tokens_outside("r1", other) == 2 * 16
    assert index.apply_delta("r1", "inc-a", 3, stored=CHAIN[4:6], evicted=[])
    assert index.pending_tokens_outside("r1", other) == 0
    # Sent and never stored (the request failed): it counts only for the TTL.
    index.record_sent("r1", 16, other)
    assert index.pending_tokens_outside("r1", CHAIN) == 5 * 16
    clock.now += 61
    assert index.pending_tokens_outside("r1", CHAIN) == 0


def test_without_fresh_events_no_queued_prefill_is_claimed() -> None:
    # The approximate mode cannot tell a queued prefill from a finished one; a stale entry
    # (a gap in the events) knows nothing until its snapshot.
    index = PrefixIndex(clock=FakeClock())
    index.record_sent("old", 16, CHAIN)
    assert index.cached_prefix_blocks("old", CHAIN) == 8
    assert index.pending_tokens_outside("old", []) == 0
    index.apply_snapshot("r1", "inc-a", 1, 16, [])
    index.record_sent("r1", 16, CHAIN)
    assert index.pending_tokens_outside("r1", []) == 8 * 16
    assert not index.apply_delta("r1", "inc-a", 5, stored=[], evicted=[])  # a gap: stale
    assert index.pending_tokens_outside("r1", []) == 0
