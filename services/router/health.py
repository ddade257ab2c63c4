"""Replica health: passive outlier ejection (pure, injected clock) and the active checks.

Passive: consecutive failures, TTFT timeouts and inter-token stalls count as
failures; enough in a row eject the replica for 30 s × (times ejected), like
Envoy, but never more than half the pool at once. Active: grpc.health.v1,
GetLoad and, now and then, a one-token generation probe per replica.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2

from services.gen.llmmesh.v1 import common_pb2, inference_pb2

if TYPE_CHECKING:
    from services.router.pool import Replica, ReplicaPool

log = logging.getLogger("llmmesh.router.health")


class FailureKind(enum.Enum):
    """What went wrong on a call to a replica."""

    ERROR = "error"
    TTFT_TIMEOUT = "ttft_timeout"
    STALL = "stall"


@dataclass(frozen=True)
class EjectionConfig:
    """Outlier-detection settings."""

    consecutive_failures: int = 3
    base_ejection_s: float = 30.0
    max_ejected_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ValueError("consecutive_failures must be >= 1")
        if self.base_ejection_s <= 0:
            raise ValueError("base_ejection_s must be > 0")


class OutlierDetector:
    """One replica's failure streak and ejection state."""

    def __init__(self, config: EjectionConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.consecutive_failures = 0
        self.ejection_count = 0
        self.ejected_until = 0.0
        self.last_failure: FailureKind | None = None

    @property
    def ejected(self) -> bool:
        return self._clock() < self.ejected_until

    def record_success(self) -> None:
        self.consecutive_failures = 0

    def record_failure(self, kind: FailureKind) -> bool:
        """Count a failure; True when the streak is long enough to eject."""
        self.consecutive_failures += 1
        self.last_failure = kind
        return self.consecutive_failures >= self.config.consecutive_failures and not self.ejected

    def eject(self) -> float:
        """Eject for base × n seconds (n = this ejection's number); returns the duration."""
        self.ejection_count += 1
        duration = self.config.base_ejection_s * self.ejection_count
        self.ejected_until = self._clock() + duration
        self.consecutive_failures = 0
        return duration

    def readmit(self) -> None:
        self.ejected_until = 0.0


def may_eject(ejected_now: int, pool_size: int, max_fraction: float) -> bool:
    """Whether one more ejection keeps the ejected share within ``max_fraction`` of the pool."""
    return pool_size > 0 and (ejected_now + 1) <= int(pool_size * max_fraction)


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
            if replica.model is None:
                info = await replica.stub.GetModelInfo(
                    inference_pb2.GetModelInfoRequest(), timeout=self.timeout_s
                )
                replica.model = info.model_id
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
        if serving and self.probe_every_s and time.monotonic() - replica.last_probe >= self.probe_every_s:
            # In the background: a busy engine's probe must not hold up everyone's load polling.
            replica.last_probe = time.monotonic()
            task = asyncio.create_task(self.probe(replica))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def probe(self, replica: Replica) -> None:
        """One-token generation: health SERVING does not prove the engine loop is alive."""
        replica.last_probe = time.monotonic()
        start = inference_pb2.GenerateStart(
            request_id=f"probe-{replica.address}",
            prompt="ping",
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0),
        )
        call = replica.stub.Generate(timeout=self.timeout_s * 5)  # type: ignore[call-arg]
        try:
            await call.write(inference_pb2.GenerateRequest(start=start))
            async for response in call:
                if response.WhichOneof("event") == "finished":
                    if response.finished.finish_reason == common_pb2.FINISH_REASON_ERROR:
                        self.pool.report_failure(replica, FailureKind.ERROR)
                    return
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy is not broken
                self.pool.report_failure(replica, FailureKind.ERROR)
        finally:
            call.cancel()
