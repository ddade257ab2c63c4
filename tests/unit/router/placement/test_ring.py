"""Consistent hashing with bounded loads: balance under skew, minimal movement."""

from __future__ import annotations

import math
import random
from collections import Counter

from services.router.placement.ring import ConsistentHashRing, bounded_capacity


def test_same_key_same_node_on_every_router() -> None:
    nodes = [f"10.0.0.{i}:50052" for i in range(5)]
    a = ConsistentHashRing(nodes)
    b = ConsistentHashRing(reversed(nodes))  # another router, another insertion order
    for i in range(200):
        assert a.owner(f"session-{i}") == b.owner(f"session-{i}")


def test_adding_a_replica_moves_about_one_nth_of_sessions() -> None:
    ring = ConsistentHashRing([f"r{i}" for i in range(4)])
    keys = [f"session-{i}" for i in range(20_000)]
    before = {k: ring.owner(k) for k in keys}
    ring.add("r4")
    moved = [k for k in keys if ring.owner(k) != before[k]]
    # Ideal share for the newcomer is 1/5 = 20 %; every moved key went to it.
    assert 0.15 < len(moved) / len(keys) < 0.25
    assert all(ring.owner(k) == "r4" for k in moved)


def test_removing_a_replica_moves_only_its_sessions_to_successors() -> None:
    ring = ConsistentHashRing([f"r{i}" for i in range(5)])
    keys = [f"s{i}" for i in range(5000)]
    before = {k: ring.owner(k) for k in keys}
    successors = {k: list(ring.walk(k))[1] for k in keys}
    ring.remove("r2")
    for k in keys:
        expected = successors[k] if before[k] == "r2" else before[k]
        assert ring.owner(k) == expected


def test_bounded_loads_cap_every_replica_under_skewed_keys() -> None:
    nodes = [f"r{i}" for i in range(6)]
    ring = ConsistentHashRing(nodes)
    rng = random.Random(7)
    # Zipf-like skew: a handful of sessions send most of the requests.
    sessions = [f"hot-{i}" for i in range(5)] * 60 + [f"s-{rng.randrange(10_000)}" for _ in range(300)]
    rng.shuffle(sessions)
    load: Counter[str] = Counter()
    for key in sessions:
        chosen = ring.choose_bounded(key, load, epsilon=0.25)
        assert chosen is not None
        load[chosen] += 1
        total = sum(load.values())
        limit = math.ceil(1.25 * total / len(nodes)) + 1
        assert max(load.values()) <= limit, (load, total)
    assert set(load) == set(nodes)


def test_bounded_choice_keeps_the_owner_while_it_has_room() -> None:
    ring = ConsistentHashRing(["a", "b", "c"])
    owner = ring.owner("session-x")
    assert ring.choose_bounded("session-x", {"a": 1, "b": 1, "c": 1}) == owner
    full = {"a": 0, "b": 0, "c": 0, owner: 5}
    overflow = ring.choose_bounded("session-x", full)
    assert overflow == list(ring.walk("session-x"))[1]


def test_ineligible_nodes_are_skipped_and_not_counted() -> None:
    ring = ConsistentHashRing(["a", "b", "c"])
    owner = ring.owner("k")
    chosen = ring.choose_bounded("k", {}, eligible=lambda n: n != owner)
    assert chosen == list(ring.walk("k"))[1]
    assert ring.choose_bounded("k", {}, eligible=lambda n: False) is None


def test_capacity_counts_the_request_being_placed() -> None:
    assert bounded_capacity(0, 4, 0.25) == 1
    assert bounded_capacity(7, 4, 0.25) == 3  # ⌈1.25 × 8 / 4⌉
