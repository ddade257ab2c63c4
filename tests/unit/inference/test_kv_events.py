"""KV events: the block manager's numbered deltas and snapshots reproduce its cached set (no torch)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from services.common.kv_blocks import block_hashes
from services.inference.block_manager import BlockManager
from services.inference.kv_events import KvEventLog
from services.inference.kv_watch import watch_kv_events
from services.inference.sampling import SamplingParams
from services.inference.sequence import Sequence

BS = 4


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(
        request_id=rid, token_ids=list(tokens), num_prompt_tokens=len(tokens), params=SamplingParams()
    )


def prefill(bm: BlockManager, s: Sequence) -> bool:
    cached = bm.match_prefix(s)
    s.num_computed_tokens = cached
    if not bm.allocate(s, s.num_tokens - cached):
        bm.free(s)
        return False
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)
    return True


def cached_set(bm: BlockManager) -> set[int]:
    return set(bm._by_hash)


def test_a_prefilled_prompt_is_stored_as_its_chain_hashes_in_one_numbered_delta() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(100, 111))  # two full blocks and a partial one
    assert prefill(bm, seq("a", prompt))
    delta = bm.events.publish()
    assert delta is not None and delta.sequence == 1
    assert list(delta.stored) == block_hashes(prompt, BS) and delta.evicted == ()
    assert bm.events.publish() is None  # nothing changed: no delta, no sequence number used


def test_eviction_of_a_reused_block_is_an_evicted_event_and_numbers_have_no_holes() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert prefill(bm, a)
    first = bm.events.publish()
    bm.free(a)  # both blocks stay cached (evictable)
    assert bm.events.publish() is None
    b = seq("b", [9, 9, 9, 9, 9])
    assert prefill(bm, b)  # takes both cached blocks: their hashes leave the cache
    second = bm.events.publish()
    assert first is not None and second is not None
    assert second.sequence == first.sequence + 1
    assert set(second.evicted) == set(first.stored)
    assert list(second.stored) == block_hashes([9, 9, 9, 9], BS)


def test_stored_then_evicted_within_one_step_cancels_out() -> None:
    log = KvEventLog(block_size=BS)
    log.stored(7)
    log.evicted(7)
    assert log.publish() is None
    log.stored(7)
    assert log.publish() is not None
    log.evicted(7)
    log.stored(7)
    assert log.publish() is None and log.snapshot().block_hashes == (7,)


def test_snapshot_then_deltas_reproduce_the_cached_set_under_random_traffic() -> None:
    rng = random.Random(22)
    bm = BlockManager(num_blocks=12, block_size=BS)
    watcher: set[int] | None = None
    at = 0
    live: list[Sequence] = []
    for step in range(400):
        op = rng.random()
        if op < 0.5:
            # A few shared prefixes, so matches, reuse and eviction all happen.
            head = [rng.randrange(3)] * BS * rng.randrange(1, 3)
            s = seq(f"r{step}", head + [rng.randrange(50) for _ in range(rng.randrange(1, 9))])
            if prefill(bm, s):
                live.append(s)
        elif op < 0.85 and live:
            bm.free(live.pop(rng.randrange(len(live))))
        elif op < 0.92 and live:
            bm.forget(set(live[0].block_table))
        else:
            bm.reset_prefix_cache()
        bm.events.publish()
        if step == 50:  # a router joins mid-way: snapshot, then deltas
            snap = bm.events.snapshot()
            watcher, at = set(snap.block_hashes), snap.sequence
        if watcher is not None and step % 7 == 0:
            deltas = bm.events.since(at)
            assert deltas is not None
            for d in deltas:
                assert d.sequence == at + 1
                at = d.sequence
                watcher.difference_update(d.evicted)
                watcher.update(d.stored)
            assert watcher == cached_set(bm)
    assert set(bm.events.snapshot().block_hashes) == cached_set(bm)


def test_a_watcher_that_falls_behind_the_ring_is_told_to_take_a_snapshot() -> None:
    log = KvEventLog(block_size=BS, capacity=3)
    for h in range(1, 6):
        log.stored(h)
        log.publish()
    assert log.since(0) is None  # deltas 1-2 are gone
    assert [d.sequence for d in log.since(2) or []] == [3, 4, 5]
    assert log.since(5) == []
    assert log.since(9) is None  # a sequence from another incarnation
    snap = log.snapshot()
    assert snap.sequence == 5 and set(snap.block_hashes) == {1, 2, 3, 4, 5}


def test_listeners_are_woken_once_per_delta_and_can_leave() -> None:
    log = KvEventLog(block_size=BS)
    woken: list[int] = []
    leave = log.subscribe(lambda: woken.append(log.sequence))
    log.stored(1)
    log.stored(2)
    log.publish()
    leave()
    log.stored(3)
    log.publish()
    assert woken == [1]


def test_each_process_start_has_its_own_incarnation() -> None:
    assert KvEventLog(BS).incarnation != KvEventLog(BS).incarnation


async def test_a_watcher_gets_the_snapshot_then_deltas_and_a_fresh_snapshot_after_falling_behind() -> None:
    log = KvEventLog(block_size=BS, capacity=2)
    log.stored(1)
    log.publish()
    stopping = asyncio.Event()
    watcher = watch_kv_events(log, stopping)
    snapshot, deltas = await anext(watcher)
    assert snapshot is not None and snapshot.sequence == 1 and snapshot.block_hashes == (1,) and deltas == []

    # Published from another thread (the engine's): the waiting watcher wakes up.
    threading.Timer(0.01, lambda: (log.stored(2), log.publish())).start()
    snapshot, deltas = await asyncio.wait_for(anext(watcher), 2)
    assert snapshot is None and [(d.sequence, d.stored) for d in deltas] == [(2, (2,))]

    # Three deltas while it was not reading: more than the ring keeps, so a snapshot instead.
    for h in (3, 4, 5):
        log.stored(h)
        log.publish()
    snapshot, deltas = await asyncio.wait_for(anext(watcher), 2)
    assert snapshot is not None and snapshot.sequence == 5 and set(snapshot.block_hashes) == {1, 2, 3, 4, 5}

    stopping.set()  # the replica drains: the stream ends
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(watcher), 2)
