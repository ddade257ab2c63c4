"""Two routers probing one real replica at the same moment: neither counts the other's probe
against it (the replica refuses a second live generation under one request id)."""

from __future__ import annotations

import asyncio

from services.common.generate_many.client import ReplicaMultiplexer
from services.router.placement.health import ActiveHealthChecker
from services.router.placement.pool import ReplicaPool
from tests.support.processes import ServiceProcess


async def test_simultaneous_probes_of_two_routers_both_pass(shared_replica: ServiceProcess) -> None:
    # Every router named its probe `probe-<replica address>`: two routers' probes of one replica
    # at once got ALREADY_EXISTS for the second, counted as a failure towards ejecting it.
    pools = [ReplicaPool(ReplicaMultiplexer) for _ in range(2)]
    try:
        for pool in pools:
            pool.set_addresses([shared_replica.address])
        replicas = [next(iter(pool.replicas.values())) for pool in pools]
        checkers = [ActiveHealthChecker(pool, probe_every_s=30.0) for pool in pools]
        for _ in range(5):
            await asyncio.gather(*(c.probe(r) for c, r in zip(checkers, replicas, strict=True)))
        assert [r.outlier.consecutive_failures for r in replicas] == [0, 0]
    finally:
        for pool in pools:
            await pool.close()
