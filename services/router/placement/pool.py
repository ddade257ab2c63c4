"""The replica pool: one reused channel per replica, its stats, candidates per model, outlier ejection.

Each replica reports its model through GetModelInfo, which groups the pool by
model; where the addresses come from is discovery.py's. The stream that carries
a replica's generations is GenerateMany's client half
(``services/common/generate_many/client.py``), which the pool is handed as a
factory (``ReplicaStreams``), so a test can hand it another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc_health.v1 import health_pb2_grpc

from services.common.generate_many.limits import STREAM_WINDOW_CHANNEL_OPTIONS
from services.gen.llmmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2
from services.router import metrics
from services.router.admission.tls import DialTls, dial
from services.router.placement.ewma import LatencyEwma, ReplicaCosts
from services.router.placement.outliers import EjectionConfig, FailureKind, OutlierDetector, may_eject

if TYPE_CHECKING:
    from services.gen.llmmesh.v1.inference_pb2_grpc import InferenceAsyncStub

log = logging.getLogger("llmmesh.router.pool")

# Keepalive finds a dead replica between requests; unlimited message size is not needed.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 15_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),  # the relay retries itself, on another replica
    # The GenerateMany stream's window is one of the protocol's flow limits, sized with the others.
    *STREAM_WINDOW_CHANNEL_OPTIONS,
]


class GenerationStream(Protocol):
    """One generation on a replica's shared stream, as the relay consumes it."""

    async def events(self) -> list[inference_pb2.GenerationEvent]: ...

    def fail(self, failure: BaseException) -> None: ...

    def close(self) -> None: ...


class ReplicaStreams(Protocol):
    """What carries a replica's generations (GenerateMany's client half, ``ReplicaMultiplexer``)."""

    def open(self, start: inference_pb2.GenerateStart, timeout_s: float | None) -> GenerationStream: ...

    async def close(self) -> None: ...


#: Builds a replica's ``ReplicaStreams`` from its stub and address; the router wires in the multiplexer.
StreamsFactory = Callable[["InferenceAsyncStub", str], ReplicaStreams]


def open_channel(address: str, tls: DialTls | None) -> grpc.aio.Channel:
    """A channel to one replica: plaintext, or TLS when the router has replica TLS settings."""
    return dial(address, tls, CHANNEL_OPTIONS)


async def generate_to_end(
    replica: Replica, start: inference_pb2.GenerateStart, timeout_s: float
) -> inference_pb2.GenerationEvent:
    """Run ``start`` on the replica's shared GenerateMany stream for its end alone: the
    ``finished`` or ``error`` event, its chunks dropped.

    The router's own short generations (health probes, pre-warm) take the same stream and the
    same conversion path as its turns, so what they prove is what a turn would meet. Raises
    ``StreamBroken`` if the stream breaks and ``TimeoutError`` past ``timeout_s`` (the replica
    is told the same limit; this one holds for a replica that never answers).
    """
    generation = replica.mux.open(start, timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                for event in await generation.events():
                    if event.WhichOneof("event") != "chunk":
                        return event
    finally:
        generation.close()


class Replica:
    """One inference replica as this router sees it."""

    def __init__(
        self,
        address: str,
        ejection: EjectionConfig,
        streams: StreamsFactory,
        clock: Callable[[], float] = time.monotonic,
        tls: DialTls | None = None,
    ) -> None:
        self.address = address
        self.channel = open_channel(address, tls)
        self.stub: InferenceAsyncStub = inference_pb2_grpc.InferenceStub(self.channel)  # type: ignore[assignment]
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        #: Every generation the router runs here shares one GenerateMany stream.
        self.mux = streams(self.stub, address)
        self.model: str | None = None
        #: None until the first health check answers.
        self.serving: bool | None = None
        self.last_load = inference_pb2.LoadReport()
        self.in_flight = 0
        self.ttft = LatencyEwma(clock=clock)
        self.itl = LatencyEwma(clock=clock)
        #: Prefill and decode costs from its answers' timings (the prefix policy's cost).
        self.costs = ReplicaCosts(clock)
        self.outlier = OutlierDetector(ejection, clock)
        self.last_probe = 0.0
        self.weight = 1.0
        #: Its first health check has answered, either way: until then its model is unknown.
        self.checked = False
        #: Tokens per KV block (ModelInfo, then its KV events' snapshot); 0 = not known yet.
        self.kv_block_size = 0
        #: Its KV events feed the prefix index now (False: approximate mode, or the stream is down).
        self.kv_events_live = False

    async def close(self) -> None:
        await self.mux.close()
        await self.channel.close(None)

    @property
    def queue_depth(self) -> int:
        return self.last_load.waiting

    @property
    def ewma_ttft_s(self) -> float | None:
        return self.ttft.value

    @property
    def ewma_itl_s(self) -> float | None:
        return self.itl.value

    @property
    def reported_load(self) -> int:
        return self.last_load.running + self.last_load.waiting

    @property
    def prefill_s_per_token(self) -> float | None:
        return self.costs.prefill_per_token.value

    @property
    def decode_s_per_request(self) -> float | None:
        return self.costs.decode_per_request.value

    @property
    def eligible(self) -> bool:
        return bool(self.serving) and not self.outlier.ejected and not self.last_load.draining

    def predicted_wait_s(self) -> float:
        """Time before this replica would start a new request: a TTFT per request queued ahead."""
        ttft = self.ttft.value or 0.0
        return ttft * self.last_load.waiting

    def status(self, wall_now_ms: int, mono_now: float, indexed_blocks: int = 0) -> router_pb2.ReplicaStatus:
        if self.last_load.draining:
            health = router_pb2.REPLICA_HEALTH_DRAINING
        elif self.serving is None:
            health = router_pb2.REPLICA_HEALTH_UNSPECIFIED
        else:
            health = (
                router_pb2.REPLICA_HEALTH_SERVING if self.serving else router_pb2.REPLICA_HEALTH_NOT_SERVING
            )
        ejected = self.outlier.ejected
        return router_pb2.ReplicaStatus(
            address=self.address,
            model=self.model or "",
            health=health,
            ejected=ejected,
            ejected_until_ms=int(wall_now_ms + (self.outlier.ejected_until - mono_now) * 1000)
            if ejected
            else 0,
            ejection_count=self.outlier.ejection_count,
            ewma_ttft_ms=(self.ttft.value or 0.0) * 1000,
            ewma_itl_ms=(self.itl.value or 0.0) * 1000,
            in_flight=self.in_flight,
            last_load=self.last_load,
            weight=self.weight,
            indexed_blocks=indexed_blocks,
            kv_events=self.kv_events_live,
        )


class ReplicaPool:
    """Every known replica, by address; candidates per model; outlier ejection."""

    def __init__(
        self,
        streams: StreamsFactory,
        ejection: EjectionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        tls: DialTls | None = None,
    ) -> None:
        self.streams = streams
        self.ejection = ejection or EjectionConfig()
        self._clock = clock
        self.tls = tls
        self.replicas: dict[str, Replica] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self.on_models_changed: list[Callable[[], None]] = []
        # Set when a replica's first check answers or a model becomes known (wait_for_models).
        self._learned = asyncio.Event()
        # The router's own first discovery and health round is over (mark_started).
        self._started = False
        #: Called when a replica stops taking work (ejected, or its health check fails).
        self.on_unavailable: list[Callable[[Replica], None]] = []
        #: Blocks the router's prefix index holds for a replica address (set by the runtime).
        self.indexed_blocks: Callable[[str], int] = lambda address: 0

    def set_addresses(self, addresses: Iterable[str]) -> None:
        """Make the pool exactly ``addresses``; a removed replica's channel closes after its streams."""
        wanted = set(addresses)
        for address in sorted(wanted - self.replicas.keys()):
            log.info("replica %s added", address)
            self.replicas[address] = Replica(address, self.ejection, self.streams, self._clock, self.tls)
        for address in sorted(self.replicas.keys() - wanted):
            log.info("replica %s removed", address)
            replica = self.replicas.pop(address)
            task = asyncio.get_running_loop().create_task(self._close_when_idle(replica))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self.models_changed()

    async def _close_when_idle(self, replica: Replica, limit_s: float = 600.0) -> None:
        waited = 0.0
        while replica.in_flight and waited < limit_s:
            await asyncio.sleep(0.5)
            waited += 0.5
        await replica.close()

    def models_changed(self) -> None:
        self._learned.set()
        for callback in self.on_models_changed:
            callback()

    def models(self) -> set[str]:
        return {r.model for r in self.replicas.values() if r.model}

    def mark_checked(self, replica: Replica) -> None:
        """``replica``'s first health check has answered (served or failed)."""
        if not replica.checked:
            replica.checked = True
            self._learned.set()

    def mark_started(self) -> None:
        """The router's first discovery and health round is over (before it, the pool may
        still be empty while the server already takes calls)."""
        self._started = True
        self._learned.set()

    def discovering(self) -> bool:
        """The router is still starting, or some replica has not answered its first health
        check yet (the replica was just added)."""
        return not self._started or any(not r.checked for r in self.replicas.values())

    async def wait_for_models(self, timeout_s: float) -> set[str]:
        """The models known, once one is known or every replica has been checked (at most
        ``timeout_s``): a request that reaches a router which started a moment ago waits for
        the first health checks (tens of ms) instead of being refused."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.models() and self.discovering():
            left = deadline - loop.time()
            if left <= 0:
                break
            self._learned.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._learned.wait(), left)
        return self.models()

    def candidates(self, model: str) -> list[Replica]:
        return [r for r in self.replicas.values() if r.model == model and r.eligible]

    def report_success(self, replica: Replica) -> None:
        replica.outlier.record_success()

    def report_failure(self, replica: Replica, kind: FailureKind) -> None:
        if not replica.outlier.record_failure(kind):
            return
        # Counted among its model's replicas, and those out for any reason (not serving,
        # draining): across the whole pool, one model's replicas could all be ejected while
        # another model's kept the count low, or the last serving ones in a rolling deploy.
        peers = [r for r in self.replicas.values() if r.model == replica.model]
        out = sum(1 for r in peers if r is not replica and not r.eligible)
        if not may_eject(out, len(peers), self.ejection.max_ejected_fraction):
            log.warning(
                "%s is failing (%s) but half of model %r's replicas are already out",
                replica.address,
                kind.value,
                replica.model,
            )
            return
        duration = replica.outlier.eject()
        metrics.EJECTIONS.inc()
        log.warning("ejected %s for %.0f s after %s", replica.address, duration, kind.value)
        self.notify_unavailable(replica)

    def set_serving(self, replica: Replica, serving: bool) -> None:
        was = replica.serving
        replica.serving = serving
        if was and not serving:
            log.warning("replica %s is not serving", replica.address)
            self.notify_unavailable(replica)

    def notify_unavailable(self, replica: Replica) -> None:
        for callback in self.on_unavailable:
            callback(replica)

    def statuses(self) -> list[router_pb2.ReplicaStatus]:
        wall_ms, mono = int(time.time() * 1000), time.monotonic()
        return [
            r.status(wall_ms, mono, self.indexed_blocks(r.address))
            for r in sorted(self.replicas.values(), key=lambda r: r.address)
        ]

    async def close(self) -> None:
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*(r.close() for r in self.replicas.values()), return_exceptions=True)
        self.replicas.clear()
