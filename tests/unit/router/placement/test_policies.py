"""Balancing policies with a controlled clock and random source (no servers)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from services.router.placement.policies import (
    AffinityPolicy,
    LatencyEwma,
    LeastOutstandingPolicy,
    PowerOfTwoChoicesPolicy,
    RoundRobinPolicy,
    WeightedResponseTimePolicy,
    make_policy,
)


@dataclass
class FakeReplica:
    """A stand-in for a pool member: only what a policy reads."""

    address: str
    in_flight: int = 0
    queue_depth: int = 0
    ttft: LatencyEwma = field(default_factory=LatencyEwma)
    itl: LatencyEwma = field(default_factory=LatencyEwma)

    @property
    def ewma_ttft_s(self) -> float | None:
        return self.ttft.value

    @property
    def ewma_itl_s(self) -> float | None:
        return self.itl.value


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_round_robin_visits_each_replica_in_turn() -> None:
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    policy = RoundRobinPolicy()
    picks = [policy.choose(replicas) for _ in range(6)]
    assert [p.address for p in picks if p] == ["a", "b", "c", "a", "b", "c"]


def test_least_outstanding_picks_the_idlest_counting_reported_queue() -> None:
    replicas = [
        FakeReplica("a", in_flight=3),
        FakeReplica("b", in_flight=1, queue_depth=4),
        FakeReplica("c", 2),
    ]
    chosen = LeastOutstandingPolicy(random.Random(1)).choose(replicas)
    assert chosen is not None and chosen.address == "c"


def test_least_outstanding_spreads_ties() -> None:
    replicas = [FakeReplica("a"), FakeReplica("b")]
    policy = LeastOutstandingPolicy(random.Random(3))
    picks = Counter(p.address for p in (policy.choose(replicas) for _ in range(200)) if p)
    assert picks["a"] > 50 and picks["b"] > 50


def test_p2c_never_picks_the_busier_of_its_two_draws() -> None:
    rng = random.Random(5)
    replicas = [FakeReplica(f"r{i}", in_flight=i) for i in range(5)]
    policy = PowerOfTwoChoicesPolicy(rng)
    picks = Counter(p.address for p in (policy.choose(replicas) for _ in range(2000)) if p)
    # The busiest replica loses every pairing it is drawn into.
    assert "r4" not in picks
    # The idlest wins every pairing it is in: drawn in 2 of 5 × 2 … 40 % of pairs.
    assert 0.33 < picks["r0"] / 2000 < 0.47
    assert picks["r0"] > picks["r1"] > picks["r2"] > picks["r3"]


def test_p2c_with_one_replica_and_none() -> None:
    policy = PowerOfTwoChoicesPolicy(random.Random(0))
    only = FakeReplica("a")
    assert policy.choose([only]) is only
    assert policy.choose([]) is None


def simulate_wrt(slow_extra_s: float, requests: int = 3000) -> Counter[str]:
    """Feed WRT the latencies its own choices would observe; count where requests went."""
    clock = FakeClock()
    replicas = [FakeReplica(n, ttft=LatencyEwma(clock=clock), itl=LatencyEwma(clock=clock)) for n in "abc"]
    policy = WeightedResponseTimePolicy(random.Random(11))
    picks: Counter[str] = Counter()
    for _ in range(requests):
        chosen = policy.choose(replicas)
        assert chosen is not None
        picks[chosen.address] += 1
        base = 0.05 + (slow_extra_s if chosen.address == "c" else 0.0)
        chosen.ttft.observe(base)
        chosen.itl.observe(0.005)
        clock.now += 0.01
    return picks


def test_wrt_sends_measurably_less_to_a_replica_slowed_by_200ms() -> None:
    picks = simulate_wrt(0.2)
    fast = (picks["a"] + picks["b"]) / 2
    # Expected time 0.21 s vs 0.41 s: the slow one should get about half a fast one's share.
    assert picks["c"] < 0.65 * fast
    assert picks["c"] > 0.3 * fast  # still probed, so its stats stay fresh


def test_wrt_spreads_evenly_when_replicas_are_alike() -> None:
    picks = simulate_wrt(0.0)
    assert max(picks.values()) / min(picks.values()) < 1.25


def test_wrt_weighs_reported_queue_depth() -> None:
    replicas = [FakeReplica("a", queue_depth=0), FakeReplica("b", queue_depth=9)]
    policy = WeightedResponseTimePolicy(random.Random(2))
    picks = Counter(p.address for p in (policy.choose(replicas) for _ in range(1000)) if p)
    assert picks["b"] < picks["a"] / 5


def test_latency_ewma_forgets_stale_samples() -> None:
    clock = FakeClock()
    ewma = LatencyEwma(alpha=0.5, stale_after_s=10, clock=clock)
    ewma.observe(1.0)
    ewma.observe(0.0)
    assert ewma.value == pytest.approx(0.5)
    clock.now = 11
    assert ewma.value is None  # unknown again: the balancer will probe it
    ewma.observe(0.2)
    assert ewma.value == pytest.approx(0.2)


def test_affinity_keeps_a_session_on_one_replica_and_uses_fallback_without_one() -> None:
    replicas = [FakeReplica(f"r{i}") for i in range(3)]
    policy = AffinityPolicy(RoundRobinPolicy())
    first = policy.choose(replicas, "session-1")
    assert all(policy.choose(replicas, "session-1") is first for _ in range(20))
    no_session = [p.address for p in (policy.choose(replicas, None) for _ in range(3)) if p]
    assert sorted(no_session) == ["r0", "r1", "r2"]


def test_affinity_moves_a_session_to_its_ring_successor_when_its_replica_leaves() -> None:
    replicas = [FakeReplica(f"r{i}") for i in range(4)]
    policy = AffinityPolicy(RoundRobinPolicy())
    home = policy.choose(replicas, "s")
    assert home is not None
    successor = list(policy.ring.walk("s"))[1]
    remaining = [r for r in replicas if r is not home]
    moved = policy.choose(remaining, "s")
    assert moved is not None and moved.address == successor


def test_affinity_overflows_when_the_home_replica_is_over_the_bound() -> None:
    replicas = [FakeReplica(f"r{i}") for i in range(4)]
    policy = AffinityPolicy(RoundRobinPolicy(), epsilon=0.25)
    home = policy.choose(replicas, "s")
    assert home is not None
    home.in_flight = 3  # cap is ⌈1.25 × 4 / 4⌉ = 2
    other = policy.choose(replicas, "s")
    assert other is not None and other is not home
    assert not policy.within_bound(home, replicas)


def test_make_policy_rejects_unknown_names_by_flag() -> None:
    assert make_policy("auto").name == "affinity"
    assert make_policy("p2c").name == "p2c"
    with pytest.raises(ValueError, match="--policy"):
        make_policy("fastest")
