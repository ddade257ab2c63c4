"""3× overload: the excess is refused fast, the accepted work runs at capacity (reliability matrix row 9).

The router admits ``--max-in-flight`` turns and refuses the rest at once with
RESOURCE_EXHAUSTED and a RetryInfo delay. Replicas are synthetic token sources
(fake, paced), so capacity is set by the admission bound, not by CPU.

Capacity is measured with closed-loop clients (one per slot); the overload is
open-loop: new turns arrive at three times that rate whatever happens to the
earlier ones, as independent users do. (Clients that retry a refusal after a
fixed 20 ms instead saturate a 2-vCPU test box with their own retries, and the
refusal latency then measures the test client's queue, not the router.)
"""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from bench.load import ClientPool, StreamOutcome, stream_once
from services.gen.llmmesh.v1 import router_pb2
from tests.reliability.mesh_support import chat, mesh, sized

# A wall-clock promise (refusals within 100 ms): make test runs it alone.
pytestmark = pytest.mark.serial

CAPACITY = 20  # --max-in-flight
TOKENS = 10  # at 20 tokens/s: 0.5 s a turn
WINDOW_S = float(sized(4, 20))
WARMUP_S = 0.5


def turn(i: int) -> router_pb2.ChatRequest:
    return chat(f"overload {i}", TOKENS)


async def drive(address: str, clients: int, seconds: float) -> tuple[list[StreamOutcome], float]:
    """Closed-loop clients for ``seconds``; a refused client waits 20 ms and tries again."""
    pool = ClientPool(address)
    outcomes: list[StreamOutcome] = []
    counter = iter(range(10**9))
    t0 = time.perf_counter()

    async def client() -> None:
        while time.perf_counter() - t0 < seconds:
            outcome = await stream_once(pool.stub(), turn(next(counter)), timeout_s=30)
            outcomes.append(outcome)
            if outcome.code == "RESOURCE_EXHAUSTED":
                await asyncio.sleep(0.02)

    try:
        await asyncio.gather(*(client() for _ in range(clients)))
    finally:
        await pool.close()
    return outcomes, t0


async def arrive(address: str, per_second: float, seconds: float) -> tuple[list[StreamOutcome], float]:
    """Open-loop arrivals: a new turn every ``1 / per_second`` s for ``seconds``, each run to its end."""
    pool = ClientPool(address)
    calls: list[asyncio.Task[StreamOutcome]] = []
    t0 = time.perf_counter()
    try:
        for i in range(int(per_second * seconds)):
            await asyncio.sleep(max(0.0, t0 + i / per_second - time.perf_counter()))
            calls.append(asyncio.create_task(stream_once(pool.stub(), turn(i), timeout_s=30)))
        outcomes = list(await asyncio.gather(*calls))
    finally:
        await pool.close()
    return outcomes, t0


def accepted_per_second(outcomes: list[StreamOutcome], t0: float, seconds: float) -> float:
    """Turns that completed in the steady part of the window, per second."""
    done = [o for o in outcomes if o.ok and t0 + WARMUP_S <= o.started + o.latency_s <= t0 + seconds]
    return len(done) / (seconds - WARMUP_S)


async def test_three_times_capacity_is_refused_fast_and_accepted_work_keeps_capacity() -> None:
    replica_args = [("--tokens-per-second", "20")] * 3
    with mesh(None, replica_args, "--max-in-flight", str(CAPACITY)) as m:
        assert m.router.proc is not None
        router = psutil.Process(m.router.proc.pid)
        baseline, t0 = await drive(m.router.address, CAPACITY, WINDOW_S)
        capacity = accepted_per_second(baseline, t0, WINDOW_S)
        rss_before = router.memory_info().rss
        overload, t1 = await arrive(m.router.address, 3 * capacity, WINDOW_S)
        accepted = accepted_per_second(overload, t1, WINDOW_S)
        rss_after = router.memory_info().rss

    refusal_p99_ms = sorted(o.latency_s * 1000 for o in overload if not o.ok)[-max(1, len(overload) // 100)]
    print(
        f"row 9: capacity {capacity:.1f}/s, accepted at 3x {accepted:.1f}/s, refusal p99 {refusal_p99_ms:.1f} ms"
    )
    assert all(o.ok for o in baseline), {o.code for o in baseline}
    refused = [o for o in overload if o.code == "RESOURCE_EXHAUSTED"]
    codes = {o.code for o in overload}
    assert codes <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert len(refused) >= CAPACITY, "3x the capacity was not refused"
    # Refused fast, and told when to come back.
    refusal_ms = sorted(o.latency_s * 1000 for o in refused)
    assert refusal_ms[int(0.99 * (len(refusal_ms) - 1))] < 100, refusal_ms[-5:]
    assert all(o.retry_after_s is not None and o.retry_after_s > 0 for o in refused)
    # The accepted turns still run at capacity: within 10 %.
    assert accepted >= 0.9 * capacity, (accepted, capacity)
    assert all(o.contiguous and len(o.positions) == TOKENS for o in overload if o.ok)
    assert rss_after - rss_before < 100 * 1024 * 1024, "router memory grew by more than 100 MiB"
