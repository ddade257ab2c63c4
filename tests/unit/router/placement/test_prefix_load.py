"""The prefix policy's load and cost with fakes: the router's own in-flight count within one poll
interval, and when a prefix group stays on the replica holding it or moves."""

from __future__ import annotations

from collections import Counter

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


def sent(replica: FakeReplica) -> None:
    """What the relay does once a request is placed: one more of this router's open there."""
    replica.in_flight += 1


def test_a_burst_inside_one_poll_interval_spreads_by_the_routers_own_in_flight_count() -> None:
    # Every replica last reported idle and no report comes during the burst.
    replicas = [FakeReplica(a) for a in ("a", "b", "c")]
    by_address = {r.address: r for r in replicas}
    pick = prefix_picker(replicas, PrefixIndex(clock=lambda: 0.0))
    placed: Counter[str] = Counter()
    for i in range(9):
        address = place(pick, request([], f"burst-{i}"))  # nothing cached anywhere: load decides
        placed[address] += 1
        sent(by_address[address])
    assert placed == {"a": 3, "b": 3, "c": 3}


def test_a_replica_that_reported_idle_but_holds_this_routers_requests_is_not_idle() -> None:
    replicas = [FakeReplica("a", reported_load=0, in_flight=5), FakeReplica("b", 2), FakeReplica("c", 2)]
    pick = prefix_picker(replicas, PrefixIndex())
    assert place(pick, request([], "next")) in {"b", "c"}
    # Another router's work, which only the report shows, counts too.
    replicas[1].reported_load, replicas[2].reported_load = 7, 1
    assert place(pick, request([], "then")) == "c"


def test_a_burst_of_one_new_prefix_waits_on_the_replica_it_went_to_until_the_bound() -> None:
    # Replicas with events, none holding the prompt. A cold 2,000-token prefill costs 2 s, a
    # request queued ahead 0.2 s: the burst queues where the first went (its blocks pending
    # there) rather than prefill the prompt cold on each replica, up to the bound's floor (4).
    replicas = [FakeReplica(a, prefill_s_per_token=1e-3, decode_s_per_request=0.2) for a in ("a", "b", "c")]
    by_address = {r.address: r for r in replicas}
    index = PrefixIndex(clock=lambda: 0.0)
    for r in replicas:
        index.apply_snapshot(r.address, "i", 1, BLOCK, [])
    pick = prefix_picker(replicas, index)
    prompt = chain(5)
    homes = []
    for i in range(5):
        address = place(pick, request(prompt, f"burst-{i}"))
        homes.append(address)
        sent(by_address[address])
    assert len(set(homes[:4])) == 1  # four on one replica: one cold prefill, three hits
    assert homes[4] != homes[0]  # the fifth is over the bound there: it spills


def test_a_group_stays_on_its_replica_while_the_work_queued_there_costs_less_than_a_cold_prefill() -> None:
    # 2,000 prompt tokens at 1 ms each: a cold prefill elsewhere is 2 s; each request queued on
    # the holder is 0.3 s. No bound in the way (floor 100): the cost alone decides.
    holder, other = (FakeReplica(a, prefill_s_per_token=1e-3, decode_s_per_request=0.3) for a in "hb")
    index = PrefixIndex()
    prompt = chain(2)
    index.apply_snapshot("h", "i", 1, BLOCK, prompt)
    index.apply_snapshot("b", "i", 1, BLOCK, [])
    pick = prefix_picker([holder, other], index, PrefixSettings(bound_floor=100))
    holder.in_flight = 6  # 1.8 s queued against a 2 s prefill: stay
    assert place(pick, request(prompt, "stay")) == "h"
    holder.in_flight = 7  # 2.1 s: moving is cheaper
    assert place(pick, request(prompt, "move")) == "b"


def test_a_new_prefix_avoids_a_replica_busy_prefilling_another_cold_prefix() -> None:
    # 2,000-token prompts at 1 ms a token, 0.2 s a queued request. "a" has one request of this
    # router in flight whose cold prefill is still queued there (its blocks sent, none stored);
    # "b" has two that are decoding. Counted as decodes alone, "a" looked cheaper (2.2 s against
    # 2.4 s); with its queued prefill it costs 4.2 s, so another prefix's request goes to "b".
    a, b = (FakeReplica(x, prefill_s_per_token=1e-3, decode_s_per_request=0.2) for x in "ab")
    index = PrefixIndex(clock=lambda: 0.0)
    for r in (a, b):
        index.apply_snapshot(r.address, "i", 1, BLOCK, [])
    pick = prefix_picker([a, b], index, PrefixSettings(bound_floor=100))
    first = chain(1)
    index.record_sent("a", BLOCK, first)
    a.in_flight, b.in_flight = 1, 2
    assert place(pick, request(chain(2), "other-prefix")) == "b"
    # The same prefix's next request waits for that prefill where it is on its way.
    assert place(pick, request(first, "same-prefix")) == "a"
    # Once "a" has stored it (prefilled, now decoding), "a" is the cheaper again.
    assert index.apply_delta("a", "i", 2, stored=first, evicted=[])
    assert place(pick, request(chain(3), "after-prefill")) == "a"
