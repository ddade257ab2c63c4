"""Pending blocks (sent, not yet stored by the replica's events) across a snapshot and over two
models: a snapshot keeps those it does not hold; a prompt hashed with another model's block size
is never pending; one hashed with another tokenizer stops counting as queued prefill once its
request is prefilled; another model's send does not wipe a replica's approximate entry."""

from __future__ import annotations

from services.router.placement.policies import PrefixSettings
from services.router.placement.prefix_index import PrefixIndex
from tests.unit.router.placement.test_prefix_policy import (
    BLOCK,
    FakeReplica,
    chain,
    place,
    prefix_picker,
    request,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


CHAIN = [0xFFFF_FFFF_FFFF_FF00 + i for i in range(8)]


# A snapshot keeps what was sent there and is not cached yet.


def test_a_snapshot_keeps_the_blocks_sent_there_that_it_does_not_hold_yet() -> None:
    clock = FakeClock()
    index = PrefixIndex(clock=clock, approximate_ttl_s=60.0)
    index.apply_snapshot("r1", "i", 1, 16, CHAIN[:2])
    index.record_sent("r1", 16, CHAIN)  # 6 blocks on their way
    # The watcher fell behind: a fresh snapshot instead of the deltas it missed. The prompt is
    # still queued there (its blocks not cached yet): it says nothing about those.
    index.apply_snapshot("r1", "i", 40, 16, CHAIN[:3])
    assert index.cached_prefix_blocks("r1", CHAIN) == 8
    # Block 2 is in the snapshot: stored, so the events rule it (it is no queued prefill) ...
    assert index.pending_tokens_outside("r1", []) == 5 * 16
    assert index.apply_delta("r1", "i", 41, stored=[], evicted=[CHAIN[2]])
    assert index.cached_prefix_blocks("r1", CHAIN) == 2  # ... and its eviction takes it away.
    # The others keep the expiry they had: counted for the TTL of their send, no longer.
    clock.now += 61
    index.apply_snapshot("r1", "i", 42, 16, CHAIN[:2])
    assert index.cached_prefix_blocks("r1", CHAIN) == 2
    assert index.pending_tokens_outside("r1", []) == 0


def test_a_restarted_replicas_snapshot_keeps_nothing_that_was_sent_to_the_old_process() -> None:
    index = PrefixIndex(clock=FakeClock())
    index.apply_snapshot("r1", "old", 1, 16, [])
    index.record_sent("r1", 16, CHAIN)
    index.apply_snapshot("r1", "new", 0, 16, [])  # another incarnation: its queue went with it
    assert index.cached_prefix_blocks("r1", CHAIN) == 0
    assert index.pending_tokens_outside("r1", []) == 0


def test_a_snapshot_after_a_gap_keeps_the_pending_blocks_of_the_stale_entry() -> None:
    index = PrefixIndex(clock=FakeClock())
    index.apply_snapshot("r1", "i", 1, 16, [])
    index.record_sent("r1", 16, CHAIN)
    assert not index.apply_delta("r1", "i", 5, stored=[], evicted=[])  # a gap: stale, resync
    index.apply_snapshot("r1", "i", 5, 16, [])
    assert index.cached_prefix_blocks("r1", CHAIN) == 8


def test_a_burst_keeps_its_prefix_on_the_replica_it_went_to_across_a_snapshot() -> None:
    # Two replicas with events, neither holding the prompt. A cold 2,000-token prefill costs
    # 2 s, a request queued ahead 0.2 s: the second request of the prompt should queue behind
    # the first where its prefix is on its way. Between the two, that replica's watcher fell
    # behind and got a snapshot (taken before the prompt's prefill stored anything).
    replicas = [FakeReplica(a, prefill_s_per_token=1e-3, decode_s_per_request=0.2) for a in "ab"]
    by_address = {r.address: r for r in replicas}
    index = PrefixIndex(clock=lambda: 0.0)
    for r in replicas:
        index.apply_snapshot(r.address, "i", 1, BLOCK, [])
    pick = prefix_picker(replicas, index)
    system = chain(4)
    first = place(pick, request([*system, 1], "q1"))
    by_address[first].in_flight += 1
    index.apply_snapshot(first, "i", 9, BLOCK, [])
    # Dropped with the snapshot (as before), the prefix was nowhere and the load sent the
    # second request to the other replica: a second cold prefill of the same 2,000 tokens.
    assert place(pick, request([*system, 2], "q2")) == first


# Two models.


def test_a_prompt_hashed_with_another_models_block_size_is_never_pending_on_a_replica() -> None:
    """Not a leak: a fallback request carries the first model's block size, and a replica whose
    events use another is never noted as on its way there (nor taken back, nor counted)."""
    index = PrefixIndex(clock=FakeClock())
    index.apply_snapshot("b1", "i", 1, 32, [])
    index.record_sent("b1", 16, CHAIN)
    assert index._precise["b1"].pending is None
    assert index.pending_tokens_outside("b1", []) == 0
    assert index.cached_prefix_blocks("b1", CHAIN, block_size=16) == 0
    index.withdraw_sent("b1", 16, CHAIN)
    assert index._precise["b1"].pending is None


def test_another_tokenizers_blocks_stop_counting_as_queued_prefill_once_prefilled() -> None:
    """A second model whose tokenizer is not the router's gets hashes its replicas' events never
    store: nothing but the TTL took them off pending, so for 120 s after every request each
    counted as another prompt's queued prefill there."""
    clock = FakeClock()
    index = PrefixIndex(clock=clock, approximate_ttl_s=120.0)
    index.apply_snapshot("b1", "i", 1, 16, [])
    index.record_sent("b1", 16, CHAIN)  # the router's hashes of model B's prompt
    assert index.pending_tokens_outside("b1", []) == 8 * 16  # queued there: right, for now
    index.apply_delta("b1", "i", 2, stored=[7001, 7002, 7003], evicted=[])  # B's own hashes
    index.prefilled("b1", 16, CHAIN)  # the request's first token: its prefill is over
    clock.now += 5
    assert index.pending_tokens_outside("b1", []) == 0  # no work on its way any more
    # Still held for the TTL: this router sent it there, as the approximate mode would hold it.
    assert index.cached_prefix_blocks("b1", CHAIN) == 8
    clock.now += 120
    assert index.cached_prefix_blocks("b1", CHAIN) == 0


def test_blocks_prefilled_before_their_store_event_arrives_are_ruled_by_the_events_after_it() -> None:
    index = PrefixIndex(clock=FakeClock())
    index.apply_snapshot("r1", "i", 1, 16, [])
    index.record_sent("r1", 16, CHAIN)
    index.prefilled("r1", 16, CHAIN)  # the first token came before the KV event
    assert index.cached_prefix_blocks("r1", CHAIN) == 8
    assert index.apply_delta("r1", "i", 2, stored=CHAIN, evicted=[])
    assert index.apply_delta("r1", "i", 3, stored=[], evicted=CHAIN[4:])
    assert index.cached_prefix_blocks("r1", CHAIN) == 4  # evicted: not held, whatever was sent
    # Sent again: on its way again, queued prefill until its prefill.
    index.record_sent("r1", 16, CHAIN)
    assert index.pending_tokens_outside("r1", []) == 4 * 16
    # A snapshot keeps prefilled-but-unreported blocks as it keeps pending ones.
    index.prefilled("r1", 16, CHAIN)
    index.apply_snapshot("r1", "i", 9, 16, CHAIN[:4])
    assert index.cached_prefix_blocks("r1", CHAIN) == 8
    assert index.pending_tokens_outside("r1", []) == 0


def test_a_second_models_replica_is_not_left_looking_busy_after_the_requests_it_served() -> None:
    # Model B's replicas b1 and b2 publish events; the router's tokenizer is model A's, so the
    # hashes of B's prompts are never stored. Two requests of B's prompt groups went to b1 and
    # were served (prefilled, answered). A third group's request finds b1 as idle as b2, with
    # more of B's cache than b2: it should not be pushed off b1 by 4,000 tokens of "queued
    # prefill" that ended long ago.
    clock = FakeClock()
    b1, b2 = (FakeReplica(a, prefill_s_per_token=1e-3, decode_s_per_request=0.2) for a in ("b1", "b2"))
    index = PrefixIndex(clock=clock, approximate_ttl_s=120.0)
    for r in (b1, b2):
        index.apply_snapshot(r.address, "i", 1, BLOCK, [])
    pick = prefix_picker([b1, b2], index, PrefixSettings(bound_floor=100))
    served = [request(chain(g), f"served-{g}") for g in (1, 2)]
    for req in served:
        index.record_sent("b1", BLOCK, req.prefix_hashes)  # placed there (as pick.place does)
        pick.prefilled(b1, req)  # the relay: its first token came
    clock.now += 10  # both answered long ago
    assert index.pending_tokens_outside("b1", chain(3)) == 0
    b2.reported_load = 1  # one request decoding on b2
    assert place(pick, request(chain(3), "third")) == "b1"


def test_another_models_send_does_not_wipe_a_replicas_approximate_entry() -> None:
    """A replica without events: a request of model A that falls back to model B's replica
    carries A's block size. One entry per replica was replaced by it, and every block B's own
    requests had noted there was lost."""
    index = PrefixIndex(clock=FakeClock())
    own = chain(1, blocks=6)
    index.record_sent("b1", 32, own)  # model B's own prompt, B's block size
    index.record_sent("b1", 16, chain(2, blocks=12))  # A's fallback request, A's block size
    assert index.cached_prefix_blocks("b1", own, block_size=32) == 6
    assert index.cached_prefix_blocks("b1", chain(2, blocks=12), block_size=16) == 12
    assert index.block_count("b1") == 18
    index.withdraw_sent("b1", 16, chain(2, blocks=12))
    assert index.cached_prefix_blocks("b1", own, block_size=32) == 6
    assert index.block_count("b1") == 6


def test_a_block_size_no_longer_sent_is_dropped_once_it_expired() -> None:
    clock = FakeClock()
    index = PrefixIndex(clock=clock, approximate_ttl_s=60.0)
    index.record_sent("r1", 16, CHAIN)
    clock.now += 61
    index.record_sent("r1", 32, CHAIN[:2])  # the replica was redeployed with 32-token blocks
    assert set(index._approximate["r1"]) == {32}
