"""Deadlines end calls on time and only ever shrink downstream (reliability matrix row 8).

The replica here is a fake that records the deadline each generation arrived
with (``timeout_s`` of its start on the router's GenerateMany stream, which is
how the router hands a replica the client's remaining time) and then stalls
before the first token, so only the deadline can end the generation: the
router must cancel it when the client's deadline passes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.gen.llmmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2_grpc
from tests.reliability.mesh_support import chat, sized
from tests.support.processes import ServiceProcess

CLIENT_DEADLINE_S = 0.3
# Slack for a Python router on a shared 2-core machine: status delivery, not a late deadline.
EPSILON_S = 0.2
# The grpc-timeout header carries a deadline rounded up to its coarse units, hop by hop.
WIRE_ROUNDING_S = 0.005


class FakeStallingReplica(inference_pb2_grpc.InferenceServicer):
    """A fake Inference replica: records each generation's deadline, then never answers."""

    def __init__(self) -> None:
        self.remaining: list[float | None] = []
        self.ended = threading.Semaphore(0)

    def GenerateMany(
        self, request_iterator: Iterator[inference_pb2.GenerateManyRequest], context: grpc.ServicerContext
    ) -> Iterator[inference_pb2.GenerateManyResponse]:
        running: set[int] = set()
        # Never answers: each generation stalls until the router cancels it.
        for request in request_iterator:
            if request.HasField("start"):
                self.remaining.append(request.timeout_s or None)
                running.add(request.tag)
            elif request.HasField("cancel") and request.tag in running:
                running.discard(request.tag)
                self.ended.release()
        return iter(())

    def GetLoad(
        self, request: inference_pb2.GetLoadRequest, context: grpc.ServicerContext
    ) -> inference_pb2.LoadReport:
        return inference_pb2.LoadReport(max_queued_requests=64)

    def GetModelInfo(
        self, request: inference_pb2.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> inference_pb2.ModelInfo:
        return inference_pb2.ModelInfo(model_id="synthetic", max_context_tokens=8192, device="fake")


@pytest.fixture(scope="module")
def stalling() -> Iterator[tuple[FakeStallingReplica, ServiceProcess]]:
    fake = FakeStallingReplica()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    inference_pb2_grpc.add_InferenceServicer_to_server(fake, server)
    checker = health.HealthServicer()
    checker.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    router = ServiceProcess(
        "services.router",
        [
            "--replicas", f"127.0.0.1:{port}", "--health-interval-s", "0.2", "--probe-interval-s", "0",
            "--ttft-timeout-s", "60", "--log-level", "WARNING",
        ],
    )  # fmt: skip
    try:
        router.start(timeout=120)
        yield fake, router
    finally:
        router.stop()
        server.stop(0)


def test_client_deadline_ends_in_deadline_exceeded_on_time_and_never_grows_downstream(
    stalling: tuple[FakeStallingReplica, ServiceProcess],
) -> None:
    fake, router = stalling
    calls = sized(10, 100)
    with grpc.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        grpc.channel_ready_future(channel).result(timeout=10)  # time the calls, not the connect
        took: list[float] = []
        before = len(fake.remaining)
        for i in range(calls):
            started = time.perf_counter()
            with pytest.raises(grpc.RpcError) as caught:
                stub.Complete(chat(f"deadline {i}", 4), timeout=CLIENT_DEADLINE_S)
            took.append(time.perf_counter() - started)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value.details()
    assert max(took) <= CLIENT_DEADLINE_S + EPSILON_S, f"slowest DEADLINE_EXCEEDED after {max(took):.3f} s"
    received = fake.remaining[before:]
    assert len(received) == calls, "not every call reached the replica"
    # Downstream deadlines never exceed the parent's: each is at most what the client allowed.
    limit = CLIENT_DEADLINE_S + WIRE_ROUNDING_S
    assert all(r is not None and 0 < r <= limit for r in received), [
        r for r in received if r is None or not 0 < r <= limit
    ]
    # And the replica's generation ends with the client's call, not later: no orphaned generation.
    for _ in range(calls):
        assert fake.ended.acquire(timeout=2.0), "a generation outlived its deadline by more than 2 s"
