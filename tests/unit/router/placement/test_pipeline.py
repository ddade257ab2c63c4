"""Each scorer, selector and the pipeline that sums them, with fakes (no servers)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from services.router.placement.filters import LoadBound, within_deadline
from services.router.placement.pipeline import Pipeline, Weighted
from services.router.placement.prefix_index import PrefixIndex
from services.router.placement.prefix_scorers import CostDefaults, PrefillWork, PrefixOverlap, QueuedWork
from services.router.placement.request import PlacementRequest, PromptPrefix
from services.router.placement.scorers import (
    InFlight,
    Outstanding,
    QueueDepth,
    ResponseTime,
    Rotation,
    SessionRing,
)
from services.router.placement.selectors import ArgMin, HashTieBreak, TwoChoices, WeightedRandom


@dataclass
class FakeReplica:
    address: str
    in_flight: int = 0
    queue_depth: int = 0
    ewma_ttft_s: float | None = None
    ewma_itl_s: float | None = None
    reported_load: int = 0
    prefill_s_per_token: float | None = None
    decode_s_per_request: float | None = None
    wait_s: float = 0.0

    def predicted_wait_s(self) -> float:
        return self.wait_s


NONE = PlacementRequest(["m"])


def test_load_scorers_read_this_routers_and_the_reported_counts() -> None:
    rs = [FakeReplica("a", in_flight=2, queue_depth=5), FakeReplica("b", in_flight=4, queue_depth=0)]
    assert InFlight().score(rs, NONE) == [2.0, 4.0]
    assert QueueDepth().score(rs, NONE) == [5.0, 0.0]
    assert Outstanding().score(rs, NONE) == [7.0, 4.0]


def test_response_time_counts_a_replica_without_samples_as_the_average() -> None:
    rs = [
        FakeReplica("a", ewma_ttft_s=0.1, ewma_itl_s=0.01),
        FakeReplica("b", ewma_ttft_s=0.3, ewma_itl_s=0.01),
        FakeReplica("new", in_flight=1),
    ]
    a, b, new = ResponseTime().score(rs, NONE)
    assert a == pytest.approx(0.1 + 0.01 * 32)
    assert b == pytest.approx(0.3 + 0.01 * 32)
    assert new == pytest.approx((0.2 + 0.01 * 32) * 2)  # mean latency, one outstanding


def test_rotation_makes_each_replica_cheapest_in_turn() -> None:
    rs = [FakeReplica(a) for a in "abc"]
    rotation = Rotation()
    assert [rotation.score(rs, NONE).index(0.0) for _ in range(4)] == [0, 1, 2, 0]


def test_session_ring_ranks_the_sessions_owner_first_and_alike_for_every_instance() -> None:
    rs = [FakeReplica(f"r{i}") for i in range(4)]
    req = PlacementRequest(["m"], session_key="acme:s1")
    ranks = SessionRing().score(rs, req)
    assert sorted(ranks) == [0.0, 1.0, 2.0, 3.0]
    assert SessionRing().score(rs, req) == ranks


def test_each_models_replicas_take_turns_when_two_models_requests_alternate() -> None:
    """One counter for every candidate set sent each model's requests to one of its replicas."""
    models = [[FakeReplica("a1"), FakeReplica("a2")], [FakeReplica("b1"), FakeReplica("b2")]]
    rotation = Rotation()
    chosen: Counter[str] = Counter()
    for i in range(40):
        rs = models[i % 2]
        chosen[rs[rotation.score(rs, NONE).index(0.0)].address] += 1
    assert chosen == {"a1": 10, "a2": 10, "b1": 10, "b2": 10}


def test_a_session_ranks_a_models_replicas_as_a_ring_of_only_them_would_with_models_alternating() -> None:
    """One ring for every model's replicas: each request ranks its own candidates in its order,
    the order a ring of only those gives, so a session's owner is the same on every router;
    the ring is not rebuilt when requests for two models alternate (it was: 12 ms a placement)."""
    a = [FakeReplica(f"a{i}") for i in range(16)]
    b = [FakeReplica(f"b{i}") for i in range(16)]
    shared = SessionRing()
    for n in range(20):
        req = PlacementRequest(["m"], session_key=f"acme:s{n}")
        for rs in (a, b, a[:5]):  # a[:5]: a retry excluding some, or an ejection
            assert shared.score(rs, req) == SessionRing().score(rs, req)
    assert len(shared.ring) == 32
    # A replica gone for good (a redeployed pod's old address) leaves the ring after a while.
    now = [0.0]
    pruned = SessionRing(clock=lambda: now[0])
    pruned.score(a, NONE)
    now[0] = 10_000.0
    pruned.score(b, NONE)
    assert len(pruned.ring) == 16


def test_prefix_scorers_price_uncached_prefill_and_queued_work() -> None:
    index = PrefixIndex()
    hashes = list(range(100, 110))
    index.apply_snapshot("a", "i", 1, 16, hashes[:4])
    rs = [
        FakeReplica("a", reported_load=3, prefill_s_per_token=1e-3, decode_s_per_request=0.5),
        FakeReplica("b", reported_load=1),
    ]
    req = PlacementRequest(["m"], prefix=PromptPrefix(hashes, 16, prompt_tokens=170))
    overlap = PrefixOverlap(index)
    assert overlap.score(rs, req) == [170 - 64, 170]
    # b has no samples: the mean of those with (a's) stands in.
    assert PrefillWork(overlap).score(rs, req) == pytest.approx([106e-3, 170e-3])
    assert QueuedWork().score(rs, req) == pytest.approx([1.5, 0.5])
    no_samples = [FakeReplica("x", reported_load=2)]
    assert QueuedWork(CostDefaults(decode_s_per_request=0.25)).score(no_samples, req) == [0.5]


def test_the_pipeline_sums_weighted_costs_and_leaves_out_replicas_over_the_bound() -> None:
    rs = [FakeReplica("a", in_flight=0, queue_depth=9), FakeReplica("b", in_flight=3, queue_depth=0)]
    by_queue = Pipeline("t", [Weighted(InFlight(), 1.0), Weighted(QueueDepth(), 0.1)], ArgMin())
    assert by_queue.costs(rs, NONE) == pytest.approx([0.9, 3.0])
    assert by_queue.select(rs, NONE) is rs[0]
    bounded = Pipeline(
        "t", [Weighted(InFlight())], ArgMin(), bound=LoadBound(0.0, load=lambda c: c.queue_depth)
    )
    assert bounded.select(rs, NONE) is rs[1]  # a's queue is over ⌈(9 + 1) / 2⌉ = 5
    assert not bounded.accepts_pin(rs[0], rs) and bounded.accepts_pin(rs[1], rs)
    with pytest.raises(ValueError, match="scorer"):
        Pipeline("t", [], ArgMin())


def test_hash_tie_break_is_a_function_of_the_request_and_spreads_keys() -> None:
    rs = [FakeReplica(a) for a in "abcd"]
    tie = HashTieBreak()
    picks = Counter(tie.pick(rs, PlacementRequest(["m"], request_id=f"r{i}")).address for i in range(400))
    assert min(picks.values()) > 60  # about 100 each
    req = PlacementRequest(["m"], request_id="same")
    assert tie.pick(rs, req) is tie.pick(list(reversed(rs)), req)


def test_weighted_random_and_two_choices_follow_the_costs() -> None:
    rs = [FakeReplica("cheap"), FakeReplica("dear")]
    weighted = WeightedRandom(random.Random(1))
    picks = Counter(weighted.select(rs, [1.0, 3.0], NONE).address for _ in range(2000))  # type: ignore[union-attr]
    assert 0.7 < picks["cheap"] / 2000 < 0.8  # 1/1 : 1/3 is 75 %
    two = TwoChoices(random.Random(2))
    assert {two.select(rs, [1.0, 3.0], NONE).address for _ in range(50)} == {"cheap"}  # type: ignore[union-attr]


def test_the_deadline_filter_keeps_those_that_start_in_time() -> None:
    rs = [FakeReplica("slow", wait_s=3.0), FakeReplica("quick", wait_s=0.2)]
    assert within_deadline(rs, 1.0).fits == [rs[1]]
    late = within_deadline(rs, 0.1)
    assert late.fits == [] and late.least_wait_s == 0.2


def test_a_prefix_without_its_block_size_is_refused_and_the_tie_key_prefers_the_session() -> None:
    with pytest.raises(ValueError, match="block size"):
        PromptPrefix([1, 2], 0)
    prefix = PromptPrefix([5, 6], 16, prompt_tokens=40)
    assert PlacementRequest(["m"], prefix=prefix).prompt_tokens == 40
    assert PlacementRequest(["m"], "acme:s", request_id="r", prefix=prefix).tie_key == "acme:s"
    assert PlacementRequest(["m"], request_id="r", prefix=prefix).tie_key == "prefix:6"
    assert PlacementRequest(["m"], request_id="r").tie_key == "r"
