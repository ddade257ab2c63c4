"""A replica dies (kill -9) or drains (SIGTERM) under load (reliability matrix rows 2 and 3).

Replicas are synthetic token sources (fake replicas, deterministic tokens), so
a stream resumed on another replica must continue with exactly the tokens the
dead one would have sent.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from grpc_health.v1 import health_pb2

from bench.load import StreamOutcome, run_closed_loop
from services.gen.llmmesh.v1 import router_pb2
from tests.reliability.mesh_support import chat, list_replicas, mesh, sized
from tests.support.router_mesh import expected_synthetic_ids

TOKENS = 30


def turn(i: int) -> router_pb2.ChatRequest:
    return chat(f"fault run {i}: a long story please", TOKENS)


def assert_exact(outcomes: list[StreamOutcome]) -> None:
    failed = [o for o in outcomes if not o.ok]
    assert not failed, f"{len(failed)} client errors, e.g. {failed[0].code}: {failed[0].details}"
    for o in outcomes:
        assert o.contiguous and len(o.positions) == TOKENS, f"gap or duplicate: {o.positions}"


async def test_kill_9_of_one_replica_under_load_loses_and_repeats_no_token(tmp_path: Path) -> None:
    streams = sized(90, 300)
    # 20 tokens/s: a stream lasts 1.5 s, so the kill lands mid-stream for every stream it hits.
    with mesh(None, [("--tokens-per-second", "20")] * 3, "--max-in-flight", "4096") as m:
        load = asyncio.create_task(run_closed_loop(m.router.address, streams, streams, turn, timeout_s=60))
        await asyncio.sleep(0.6)
        in_flight = {r.address: r.in_flight for r in list_replicas(m.router.address)}
        victim = max(m.replicas, key=lambda r: in_flight[r.address])
        victim.kill()
        killed_at = time.perf_counter()
        # Every RPC reaches a final status, within a bound.
        outcomes = await asyncio.wait_for(load, timeout=60)

        assert_exact(outcomes)
        expected = {tuple(expected_synthetic_ids(turn(i))) for i in range(streams)}
        assert {tuple(o.token_ids) for o in outcomes} == expected, "a resumed stream's tokens differ"
        assert all(o.replica != victim.address for o in outcomes), "a stream ended on the dead replica"
        moved = [o for o in outcomes if o.failovers]
        # Only the dead replica's streams moved; survivors' streams were not touched.
        assert 1 <= len(moved) <= in_flight[victim.address], (len(moved), in_flight)
        assert all(o.failovers == 0 and o.retries == 0 for o in outcomes if o.started > killed_at + 0.5)

        # After ejection nothing new is sent to the dead replica: no retry, no failover.
        after = await run_closed_loop(m.router.address, 10, 30, lambda i: turn(1000 + i), timeout_s=30)
        assert_exact(after)
        assert all(o.replica != victim.address and o.retries == 0 and o.failovers == 0 for o in after)
        pool = {r.address: r for r in list_replicas(m.router.address)}
        assert (
            pool[victim.address].health != router_pb2.REPLICA_HEALTH_SERVING or pool[victim.address].ejected
        )


async def test_sigterm_drain_of_a_replica_under_load_gives_clients_zero_errors(tmp_path: Path) -> None:
    clients = sized(45, 150)
    drain = ("--tokens-per-second", "20", "--drain-seconds", "1", "--grace-seconds", "20")
    replica_args = [drain, ("--tokens-per-second", "20"), ("--tokens-per-second", "20")]
    with mesh(None, replica_args, "--max-in-flight", "4096") as m:
        victim = m.replicas[0]
        load = asyncio.create_task(
            run_closed_loop(m.router.address, clients, clients * 4, turn, timeout_s=60)
        )
        await asyncio.sleep(1.0)
        victim_streams = {r.address: r.in_flight for r in list_replicas(m.router.address)}[victim.address]
        victim.signal(signal.SIGTERM)
        signalled_at = time.perf_counter()
        # Health says NOT_SERVING first, while the process still runs and serves its streams.
        await asyncio.sleep(0.1)
        assert victim.proc is not None and victim.proc.poll() is None
        assert victim.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        outcomes = await asyncio.wait_for(load, timeout=90)
        assert victim.proc.wait(30) == 0, "the drained replica did not exit cleanly"
        # It exits once its streams are done, not at the end of its 20 s grace period: the router's
        # long-lived GenerateMany stream ends when the generations on it have.
        assert time.perf_counter() - signalled_at < 10, "the drained replica waited out its grace period"

    assert victim_streams > 0, "the victim had no stream when it was told to drain"
    assert_exact(outcomes)
    # In-flight streams finished where they were: no failover was needed.
    assert sum(o.failovers for o in outcomes) == 0
    # Once the router saw the drain (health polled every 0.2 s), new turns went elsewhere.
    late = [o for o in outcomes if o.started > signalled_at + 0.6]
    assert late and all(o.replica != victim.address for o in late)
