"""The replica picker without servers: deadline filter, session pins within the load bound, the policy."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.common import errors
from services.router.placement.picker import ReplicaPicker
from services.router.placement.policies import (
    AffinityPolicy,
    BalancingPolicy,
    LeastOutstandingPolicy,
    RoundRobinPolicy,
)


@dataclass
class FakeReplica:
    """Stands in for a pool replica: only the load facts the picker and the policies read."""

    address: str
    in_flight: int = 0
    queue_depth: int = 0
    ewma_ttft_s: float | None = None
    ewma_itl_s: float | None = None
    wait_s: float = 0.0

    def predicted_wait_s(self) -> float:
        return self.wait_s


@dataclass
class FakePool:
    """Stands in for the replica pool: fixed candidates per model."""

    by_model: dict[str, list[FakeReplica]] = field(default_factory=dict)

    def candidates(self, model: str) -> list[FakeReplica]:
        return list(self.by_model.get(model, []))


def picker(
    pool: FakePool, policy: BalancingPolicy | None = None, now: float = 0.0
) -> ReplicaPicker[FakeReplica]:
    return ReplicaPicker(pool, policy or AffinityPolicy(LeastOutstandingPolicy()), clock=lambda: now)


def test_replicas_whose_predicted_wait_misses_the_deadline_are_left_out() -> None:
    slow, quick = FakeReplica("slow", wait_s=5.0), FakeReplica("quick", wait_s=0.1)
    pick = picker(FakePool({"m": [slow, quick]}), now=10.0)
    for _ in range(5):
        assert pick.pick(["m"], None, set(), deadline=11.0) == (quick, "m")


def test_every_replica_too_slow_for_the_deadline_is_a_deadline_error() -> None:
    pool = FakePool({"m": [FakeReplica("a", wait_s=3.0), FakeReplica("b", wait_s=2.0)]})
    with pytest.raises(errors.DeadlineExceeded, match=r"predicted queue wait 2\.00 s"):
        picker(pool, now=0.0).pick(["m"], None, set(), deadline=1.0)
    assert picker(pool, now=0.0).pick(["m"], None, set(), deadline=None) is not None


def test_a_pinned_replica_within_the_load_bound_keeps_its_session() -> None:
    a, b = FakeReplica("a", in_flight=1), FakeReplica("b", in_flight=1)
    pick = picker(FakePool({"m": [a, b]}))
    assert pick.pick(["m"], "acme:s1", set(), None, preferred="b") == (b, "m")
    assert pick.pick(["m"], "acme:s1", set(), None, preferred="a") == (a, "m")


def test_a_pinned_replica_over_the_load_bound_is_skipped_for_the_policy() -> None:
    # 12 in flight on 2 replicas, epsilon 0.25: the cap is ⌈1.25 · (12 + 1) / 2⌉ = 9, and 10 is over it.
    busy, idle = FakeReplica("busy", in_flight=10), FakeReplica("idle", in_flight=2)
    pick = picker(FakePool({"m": [busy, idle]}), AffinityPolicy(LeastOutstandingPolicy(), epsilon=0.25))
    picked = pick.pick(["m"], "acme:s1", set(), None, preferred="busy")
    assert picked == (idle, "m")


def test_a_policy_without_a_load_bound_always_honours_the_pin() -> None:
    busy, idle = FakeReplica("busy", in_flight=10), FakeReplica("idle")
    pick = picker(FakePool({"m": [busy, idle]}), LeastOutstandingPolicy())
    assert pick.pick(["m"], "acme:s1", set(), None, preferred="busy") == (busy, "m")


def test_without_a_usable_pin_the_policy_chooses() -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    pick = picker(FakePool({"m": [a, b]}), RoundRobinPolicy())
    # No pin, then a pin to a replica already tried: round robin takes each in turn.
    assert [pick.pick(["m"], None, set(), None) for _ in range(2)] == [(a, "m"), (b, "m")]
    assert pick.pick(["m"], "acme:s1", {"b"}, None, preferred="b") == (a, "m")


def test_the_next_model_is_tried_when_one_has_no_candidate_left() -> None:
    fallback = FakeReplica("f")
    pool = FakePool({"primary": [FakeReplica("p")], "fallback": [fallback]})
    assert picker(pool).pick(["primary", "fallback"], None, {"p"}, None) == (fallback, "fallback")
    assert picker(pool).pick(["primary", "fallback"], None, {"p", "f"}, None) is None
