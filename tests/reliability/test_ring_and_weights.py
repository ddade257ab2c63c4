"""Ring changes and slow replicas (reliability matrix row 13).

Adding a replica to the router's consistent-hash ring moves about 1/N of the
sessions, all of them to the newcomer; a replica slowed by 200 ms (through
the fault proxy) gets a smaller share under weighted response time. Replicas
are synthetic token sources (fake, no model).
"""

from __future__ import annotations

from collections import Counter

from bench.load import run_closed_loop
from services.gen.llmmesh.v1 import router_pb2
from services.router.placement.ring import ConsistentHashRing
from tests.reliability.mesh_support import Mesh, chat, sized, synthetic_replica
from tests.support.processes import ServiceProcess
from tests.support.proxy import FaultProxy

SESSIONS = 20_000
REPLICAS = [f"10.0.0.{i}:50052" for i in range(1, 5)]


def test_adding_a_replica_moves_about_one_nth_of_sessions_all_to_the_newcomer() -> None:
    keys = [f"tenant:session-{i}" for i in range(SESSIONS)]
    ring = ConsistentHashRing(REPLICAS[:3])
    before = {k: ring.owner(k) for k in keys}
    ring.add(REPLICAS[3])
    after = {k: ring.owner(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    share = len(moved) / SESSIONS
    assert 0.8 / 4 <= share <= 1.25 / 4, f"{share:.3f} of sessions moved; expected about 1/4"
    assert {after[k] for k in moved} == {REPLICAS[3]}, "sessions moved between replicas that stayed"
    # Removing it again puts exactly those sessions back where they were.
    ring.remove(REPLICAS[3])
    assert {k: ring.owner(k) for k in keys} == before


async def test_a_replica_slowed_by_200_ms_gets_a_smaller_share_under_weighted_response_time() -> None:
    turns = sized(150, 600)
    m = Mesh()
    proxy: FaultProxy | None = None
    try:
        m.replicas = [synthetic_replica("--tokens-per-second", "1000") for _ in range(3)]
        for r in m.replicas:
            r.start(timeout=120)
        proxy = FaultProxy(m.replicas[2].address).start()
        proxy.delay_s = 0.2
        slowed = proxy.address
        # The router reaches the third replica only through the proxy.
        fast = ",".join(r.address for r in m.replicas[:2])
        router_args = ["--replicas", f"{fast},{slowed}", "--policy", "wrt", "--health-interval-s", "0.2"]
        m.routers.append(ServiceProcess("services.router", [*router_args, "--probe-interval-s", "0"]))
        m.router.start(timeout=120)

        def turn(i: int) -> router_pb2.ChatRequest:
            return chat(f"weighted {i}", 4)

        outcomes = await run_closed_loop(m.router.address, 3, turns, turn, timeout_s=30)
    finally:
        m.stop()
        if proxy is not None:
            proxy.stop()
    assert all(o.ok for o in outcomes), {o.code for o in outcomes}
    shares = Counter(o.replica for o in outcomes)
    slow_share = shares[slowed] / turns
    print(f"row 13: slowed replica share {slow_share:.2f} of {turns} turns ({dict(shares)})")
    # An even split would be 1/3 each; WRT weighs by 1/expected time, so the slowed one gets
    # clearly less (under a tenth here), but not nothing: its stats stay fresh.
    assert 0 < slow_share < 0.2, shares
