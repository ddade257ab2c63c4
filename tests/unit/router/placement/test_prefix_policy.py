"""The prefix policy through the replica picker, with fakes: longest cached prefix, the load bound,
a hot prefix spreading, identical choices on two routers, the approximate mode feeding back."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest

from services.router.placement.ewma import ReplicaCosts
from services.router.placement.picker import ReplicaPicker
from services.router.placement.policies import PrefixPolicy, PrefixSettings, make_policy
from services.router.placement.prefix_index import PrefixIndex
from services.router.placement.request import PlacementRequest, PromptPrefix

BLOCK = 16


@dataclass
class FakeReplica:
    """A pool member as the prefix policy reads it: reported load and learned costs."""

    address: str
    reported_load: int = 0
    prefill_s_per_token: float | None = None
    decode_s_per_request: float | None = None
    in_flight: int = 0
    queue_depth: int = 0
    ewma_ttft_s: float | None = None
    ewma_itl_s: float | None = None

    def predicted_wait_s(self) -> float:
        return 0.0


@dataclass
class FakePool:
    replicas: list[FakeReplica] = field(default_factory=list)

    def candidates(self, model: str) -> list[FakeReplica]:
        return list(self.replicas)


def chain(group: int, blocks: int = 125) -> list[int]:
    """A prompt's chained block hashes: ``group`` tells prompts with different prefixes apart."""
    return [(group << 32) | i for i in range(blocks)]


def request(hashes: list[int], request_id: str = "req", session: str | None = None) -> PlacementRequest:
    return PlacementRequest(["m"], session, request_id=request_id, prefix=PromptPrefix(hashes, BLOCK))


def prefix_picker(
    replicas: list[FakeReplica], index: PrefixIndex, settings: PrefixSettings | None = None
) -> ReplicaPicker[FakeReplica]:
    return ReplicaPicker(FakePool(replicas), PrefixPolicy(index, settings), clock=lambda: 0.0)


def place(pick: ReplicaPicker[FakeReplica], req: PlacementRequest) -> str:
    placed = pick.place(req)
    assert placed is not None
    return placed[0].address


def test_the_longest_cached_prefix_wins_when_loads_are_equal() -> None:
    replicas = [FakeReplica(a, reported_load=2) for a in ("a", "b", "c")]
    index = PrefixIndex()
    prompt = chain(1)
    index.apply_snapshot("a", "i", 1, BLOCK, prompt[:20])
    index.apply_snapshot("b", "i", 1, BLOCK, prompt[:90])
    index.apply_snapshot("c", "i", 1, BLOCK, prompt[:40])
    pick = prefix_picker(replicas, index)
    assert {place(pick, request(prompt, f"r{i}")) for i in range(20)} == {"b"}


def test_a_replica_over_its_bound_is_skipped_even_with_the_best_prefix() -> None:
    # Reported loads 9, 1, 1 and ε = 0.5: the cap is ⌈1.5 · (11 + 1) / 3⌉ = 6, and 9 is over it.
    replicas = [FakeReplica("holder", 9), FakeReplica("b", 1), FakeReplica("c", 1)]
    index = PrefixIndex()
    prompt = chain(1)
    index.apply_snapshot("holder", "i", 1, BLOCK, prompt)
    # b and c publish events and hold none of it.
    index.apply_snapshot("b", "i", 1, BLOCK, [])
    index.apply_snapshot("c", "i", 1, BLOCK, [])
    # Even with load weighing nothing, the bound alone keeps the request off the holder.
    pick = prefix_picker(replicas, index, PrefixSettings(load_weight=0.0, epsilon=0.5))
    assert place(pick, request(prompt)) in {"b", "c"}
    # Under the cap it would have won on its prefix.
    replicas[0].reported_load = 5  # the cap is now ⌈1.5 · 8 / 3⌉ = 4 … and 5 is not under it
    assert place(pick, request(prompt)) in {"b", "c"}
    replicas[0].reported_load = 3
    # What went to b and c is pending there (sent, not yet stored): their events say they
    # prefilled it and have evicted it since. (A snapshot alone would not say so: it keeps
    # what was sent there and is not cached, which may still be queued.)
    for r in ("b", "c"):
        assert index.apply_delta(r, "i", 2, stored=prompt, evicted=[])
        assert index.apply_delta(r, "i", 3, stored=[], evicted=prompt)
    assert place(pick, request(prompt)) == "holder"


def test_near_idle_no_replica_is_over_the_bound_below_its_floor() -> None:
    # Loads 1, 0, 0: ⌈1.5 · 2 / 3⌉ = 1 would already refuse the holder; the floor (4) does not.
    replicas = [FakeReplica("holder", 1), FakeReplica("b"), FakeReplica("c")]
    index = PrefixIndex()
    prompt = chain(1)
    index.apply_snapshot("holder", "i", 1, BLOCK, prompt)
    assert place(prefix_picker(replicas, index), request(prompt)) == "holder"
    no_floor = PrefixSettings(bound_floor=0)
    assert place(prefix_picker(replicas, index, no_floor), request(prompt)) != "holder"


@pytest.mark.parametrize("load_weight", [1.0, 0.0], ids=["cost", "bound-only"])
def test_a_hot_prefix_spreads_over_more_replicas_under_skewed_load(load_weight: float) -> None:
    replicas = [FakeReplica("hot", 4), FakeReplica("b", 1), FakeReplica("c", 0)]
    index = PrefixIndex()
    prompt = chain(7)
    index.apply_snapshot("hot", "i", 1, BLOCK, prompt)
    settings = PrefixSettings(load_weight=load_weight, epsilon=0.5)
    pick = prefix_picker(replicas, index, settings)
    by_address = {r.address: r for r in replicas}
    placed: Counter[str] = Counter()
    for i in range(30):
        loads = [r.reported_load for r in replicas]
        cap = max(-(-(1.5 * (sum(loads) + 1)) // 3), 4)  # ⌈(1 + ε) · (total + 1) / n⌉, floor 4
        address = place(pick, request(prompt, f"r{i}"))
        placed[address] += 1
        chosen = by_address[address]
        assert chosen.reported_load < cap  # never placed over the bound
        # The replica reports the new request and publishes the blocks it stored.
        chosen.reported_load += 1
        last = index.sequence(address)
        if last is None:
            index.apply_snapshot(address, "i", 0, BLOCK, [])
            last = 0
        assert index.apply_delta(address, "i", last + 1, stored=prompt, evicted=[])
    assert len(placed) >= 2
    assert placed["hot"] < 30 - 10  # the holder took no more than its bounded share


def test_two_routers_with_the_same_loads_and_index_place_every_request_identically() -> None:
    def router() -> ReplicaPicker[FakeReplica]:
        index = PrefixIndex()
        # Both consume the same events: group 1 on a and b, group 2 partly on c.
        index.apply_snapshot("a", "i", 1, BLOCK, chain(1))
        index.apply_snapshot("b", "i", 1, BLOCK, chain(1))
        index.apply_snapshot("c", "i", 1, BLOCK, chain(2)[:60])
        replicas = [FakeReplica("a", 3), FakeReplica("b", 3), FakeReplica("c", 2), FakeReplica("d", 2)]
        return prefix_picker(replicas, index)

    first, second = router(), router()
    # First with nothing sent yet (every replica ties on cost), then the groups, whose sends
    # queue prefills that the costs of later requests count.
    requests = [request([], f"no-prefix-{i}") for i in range(20)]
    requests += [request(chain(g), f"id-{g}-{i}") for g in range(6) for i in range(10)]
    picks = [place(first, r) for r in requests]
    assert picks == [place(second, r) for r in requests]
    # Ties (no prefix at all; a and b both hold group 1) still spread, by the request's key.
    assert set(picks[:20]) == {"c", "d"}  # the two least loaded, both used
    assert set(picks[30:40]) == {"a"} or set(picks[30:40]) == {"b"}  # one prompt: one replica


def test_without_events_the_router_remembers_where_it_sent_a_prefix() -> None:
    replicas = [FakeReplica(a) for a in ("a", "b", "c")]
    pick = prefix_picker(replicas, PrefixIndex(clock=lambda: 0.0))
    homes = {g: place(pick, request(chain(g), f"first-{g}")) for g in range(12)}
    assert len(set(homes.values())) >= 2  # fresh prefixes spread over the replicas
    for g, home in homes.items():
        assert place(pick, request(chain(g), f"again-{g}")) == home


def test_a_prompt_that_never_reached_prefill_is_not_counted_on_its_way_there() -> None:
    """A 40,000-token prompt refused by its replica (too long, busy, cancelled while queued) was
    counted as on its way there for 120 s: that replica held it as 40,000 tokens of queued
    prefill and got none of the next 30 prompts. Withdrawn, the replica is as before."""
    replicas = [FakeReplica(a) for a in ("a", "b", "c")]
    index = PrefixIndex(clock=lambda: 0.0)
    for r in replicas:
        index.apply_snapshot(r.address, "inc", 1, BLOCK, [])  # fresh KV events from each
    pick = prefix_picker(replicas, index)
    huge = request(chain(999, blocks=40_000 // BLOCK), "huge")
    placed = pick.place(huge)
    assert placed is not None
    home = placed[0]
    assert index.pending_tokens_outside(home.address, chain(1)) >= 40_000 - BLOCK
    pick.withdraw(home, huge)
    assert index.pending_tokens_outside(home.address, chain(1)) == 0
    spread = Counter(place(pick, request(chain(g), f"next-{g}")) for g in range(30))
    assert spread[home.address] >= 5  # it takes its share again


def test_the_cheaper_prefill_wins_where_no_replica_holds_the_prompt() -> None:
    replicas = [FakeReplica("slow", prefill_s_per_token=4e-4), FakeReplica("fast", prefill_s_per_token=1e-4)]
    pick = prefix_picker(replicas, PrefixIndex())
    assert place(pick, request(chain(3))) == "fast"
    # A replica without samples counts as the mean of those with: between the two.
    replicas.append(FakeReplica("new"))
    assert place(pick, request(chain(4))) == "fast"


def test_a_pin_holds_within_the_reported_load_bound_only() -> None:
    replicas = [FakeReplica("pinned", 9), FakeReplica("b", 1), FakeReplica("c", 1)]
    pick = prefix_picker(replicas, PrefixIndex())
    pinned = PlacementRequest(["m"], "acme:s1", pinned="pinned")
    assert place(pick, pinned) != "pinned"
    replicas[0].reported_load = 3
    assert place(pick, pinned) == "pinned"


def test_costs_are_learned_from_a_replicas_timings() -> None:
    costs = ReplicaCosts(clock=lambda: 0.0)
    costs.observe(prompt_tokens=1000, cached_tokens=200, prefill_s=0.16, decode_s=0.5)
    assert costs.prefill_per_token.value == pytest.approx(0.16 / 800)
    assert costs.decode_per_request.value == pytest.approx(0.5)
    costs.observe(prompt_tokens=1000, cached_tokens=995, prefill_s=0.01, decode_s=0.0)
    assert costs.prefill_per_token.value == pytest.approx(0.16 / 800)  # 5 tokens: too few to learn from


def test_the_prefix_policy_is_a_flag_and_its_settings_are_checked_by_flag_name() -> None:
    assert make_policy("prefix").name == "prefix"
    assert make_policy("auto").name == "affinity"  # the default is unchanged
    with pytest.raises(ValueError, match="--prefix-epsilon"):
        PrefixSettings(epsilon=-1)
    with pytest.raises(ValueError, match="--prefix-load-weight"):
        PrefixSettings(load_weight=float("nan"))
    with pytest.raises(ValueError, match="--prefix-bound-floor"):
        PrefixSettings(bound_floor=-1)
    with pytest.raises(ValueError, match="--prefix-approximate-ttl-s"):
        PrefixSettings(approximate_ttl_s=0)


def test_a_bad_prefix_flag_stops_the_router_with_the_flag_named(capsys: pytest.CaptureFixture[str]) -> None:
    from services.router.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["--replicas", "127.0.0.1:1", "--policy", "prefix", "--prefix-epsilon", "-0.5"])
    assert stopped.value.code == 2
    assert "--prefix-epsilon must be a finite number >= 0" in capsys.readouterr().err
