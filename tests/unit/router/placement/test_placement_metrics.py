"""Placement metrics move with the decisions: reasons by label, prefix-hit tokens per hashed prompt."""

from __future__ import annotations

from prometheus_client import REGISTRY

from services.router.placement.picker import ReplicaPicker
from services.router.placement.policies import (
    AffinityPolicy,
    PrefixPolicy,
    PrefixSettings,
    RoundRobinPolicy,
)
from services.router.placement.prefix_index import PrefixIndex
from services.router.placement.request import PlacementRequest, PromptPrefix
from services.router.streams.relay import count_placement
from tests.unit.router.placement.test_prefix_policy import BLOCK, FakePool, FakeReplica, chain


def placements(reason: str) -> float:
    return REGISTRY.get_sample_value("llmmesh_router_placements_total", {"reason": reason}) or 0.0


def hits() -> tuple[float, float, float]:
    count = REGISTRY.get_sample_value("llmmesh_router_prefix_hit_tokens_count") or 0.0
    total = REGISTRY.get_sample_value("llmmesh_router_prefix_hit_tokens_sum") or 0.0
    prompt = REGISTRY.get_sample_value("llmmesh_router_prefix_prompt_tokens_total") or 0.0
    return count, total, prompt


def counted(pool: FakePool, policy: object) -> ReplicaPicker[FakeReplica]:
    return ReplicaPicker(pool, policy, clock=lambda: 0.0, on_decision=count_placement)  # type: ignore[arg-type]


def test_a_prefix_placement_counts_its_reason_and_the_tokens_it_hit() -> None:
    pool = FakePool([FakeReplica(a) for a in ("a", "b", "c")])
    index = PrefixIndex()
    prompt = chain(7, blocks=10)
    index.apply_snapshot("b", "i", 1, BLOCK, prompt[:6])
    picker = counted(pool, PrefixPolicy(index, PrefixSettings()))
    before_prefix, before_load, (n0, sum0, prompt0) = placements("prefix"), placements("load"), hits()

    placed = picker.place(PlacementRequest(["m"], prefix=PromptPrefix(prompt, BLOCK)))
    assert placed is not None and placed[0].address == "b"
    assert placements("prefix") == before_prefix + 1
    n1, sum1, prompt1 = hits()
    assert (n1 - n0, sum1 - sum0, prompt1 - prompt0) == (1, 6 * BLOCK, 10 * BLOCK)

    # A prompt nobody holds goes by load, and hits nothing.
    picker.place(PlacementRequest(["m"], prefix=PromptPrefix(chain(8, blocks=4), BLOCK)))
    assert placements("load") == before_load + 1
    n2, sum2, _ = hits()
    assert (n2 - n1, sum2 - sum1) == (1, 0)


def test_session_placements_count_ring_and_pin() -> None:
    pool = FakePool([FakeReplica(a) for a in ("a", "b", "c")])
    picker = counted(pool, AffinityPolicy(RoundRobinPolicy()))
    ring, pin, fallback, load = (placements(r) for r in ("ring", "pin", "fallback", "load"))

    first = picker.place(PlacementRequest(["m"], "tenant:s1"))
    assert first is not None
    assert placements("ring") == ring + 1
    picker.place(PlacementRequest(["m"], "tenant:s1", pinned=first[0].address))
    assert placements("pin") == pin + 1
    picker.place(PlacementRequest(["m"]))  # no session: round robin decides by load
    assert placements("load") == load + 1

    assert placements("ring") == ring + 1  # the pinned and the unkeyed turns were not ring choices
    assert placements("fallback") == fallback


def test_a_later_model_of_the_plan_counts_as_fallback() -> None:
    class OneModelPool(FakePool):
        def candidates(self, model: str) -> list[FakeReplica]:
            return list(self.replicas) if model == "small" else []

    picker = counted(OneModelPool([FakeReplica("a")]), RoundRobinPolicy())
    before = placements("fallback")
    placed = picker.place(PlacementRequest(["big", "small"]))
    assert placed is not None and placed[1] == "small"
    assert placements("fallback") == before + 1
