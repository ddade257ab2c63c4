"""Active replica health checks: grpc.health.v1, GetLoad, model info and a periodic one-token probe.

Passive ejection on failed calls is the outlier detector's (outliers.py); this
module polls, and reports what it finds to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
from grpc_health.v1 import health_pb2

from services.common.generate_many.client import StreamBroken
from services.gen.llmmesh.v1 import common_pb2, inference_pb2
from services.router.placement.outliers import FailureKind
from services.router.placement.pool import Replica, ReplicaPool, generate_to_end

log = logging.getLogger("llmmesh.router.health")


class ActiveHealthChecker:
    """Polls every replica: health, load, model info, and a periodic one-token probe."""

    def __init__(
        self,
        pool: ReplicaPool,
        interval_s: float = 1.0,
        probe_every_s: float = 30.0,
        timeout_s: float = 2.0,
    ) -> None:
        self.pool = pool
        self.interval_s = interval_s
        self.probe_every_s = probe_every_s
        self.timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="router-health")

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self._probes] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        replicas = list(self.pool.replicas.values())
        if replicas:
            await asyncio.gather(*(self.check(r) for r in replicas), return_exceptions=True)

    async def check(self, replica: Replica) -> None:
        try:
            await self._check(replica)
        finally:
            # Answered, failed or broken: either way turns need not wait for it any more.
            self.pool.mark_checked(replica)

    async def _check(self, replica: Replica) -> None:
        try:
            response = await replica.health_stub.Check(
                health_pb2.HealthCheckRequest(), timeout=self.timeout_s
            )
            serving = response.status == health_pb2.HealthCheckResponse.SERVING
            # Asked again whenever the replica was not serving at its last check: a redeploy at
            # the same address may serve another model, whose traffic kept the old one's name.
            if replica.model is None or (serving and replica.serving is not True):
                info = await replica.stub.GetModelInfo(
                    inference_pb2.GetModelInfoRequest(), timeout=self.timeout_s
                )
                if (info.model_id, info.kv_block_size) != (replica.model, replica.kv_block_size):
                    if replica.model is not None:
                        log.warning(
                            "replica %s now serves %r (was %r)", replica.address, info.model_id, replica.model
                        )
                    replica.model = info.model_id
                    replica.kv_block_size = info.kv_block_size
                    self.pool.models_changed()
        except grpc.aio.AioRpcError as exc:
            self.pool.set_serving(replica, False)
            log.debug("health check of %s failed: %s", replica.address, exc.code().name)
            return
        self.pool.set_serving(replica, serving)
        self.pool.mark_checked(replica)  # now, not after GetLoad: its model and health are known
        try:
            replica.last_load = await replica.stub.GetLoad(
                inference_pb2.GetLoadRequest(), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            # A broken load report is not a dead replica: balance on what this router sees.
            log.warning("GetLoad of %s failed: %s %s", replica.address, exc.code().name, exc.details())
        if serving and self.probe_due(replica, time.monotonic()):
            # In the background: a busy engine's probe must not hold up everyone's load polling.
            replica.last_probe = time.monotonic()
            task = asyncio.create_task(self.probe(replica))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    def probe_due(self, replica: Replica, now: float) -> bool:
        """A probe is due a period after the last one, unless tokens prove the engine alive.

        Tokens this router received within the period are the evidence the probe would give:
        and on a replica whose seats are all taken, a probe would only wait in its queue behind
        the turns (and might time out there, marking a busy replica as failed).
        """
        if not self.probe_every_s or now - replica.last_probe < self.probe_every_s:
            return False
        last_token = replica.itl.last_sample_at
        return last_token is None or now - last_token >= self.probe_every_s

    async def probe(self, replica: Replica) -> None:
        """One-token generation: health SERVING does not prove the engine loop is alive.

        It runs on the replica's GenerateMany stream, as every turn does: a probe over another
        RPC could pass while the stream turns are on is broken.
        """
        replica.last_probe = time.monotonic()
        start = inference_pb2.GenerateStart(
            # Unique: the replica refuses a second live generation under one id (ALREADY_EXISTS),
            # and two routers probing one replica at once counted that as its failure.
            request_id=f"probe-{uuid.uuid4().hex}",
            prompt="ping",
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0),
        )
        try:
            end = await generate_to_end(replica, start, self.timeout_s * 5)
        except StreamBroken as exc:
            failed = exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED  # busy is not broken
        except TimeoutError:
            failed = True
        else:
            if end.WhichOneof("event") == "error":
                failed = end.error.code != grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            else:
                failed = end.finished.finish_reason == common_pb2.FINISH_REASON_ERROR
        if failed:
            self.pool.report_failure(replica, FailureKind.ERROR)
