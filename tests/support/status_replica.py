"""A fake inference replica that answers every generation with the status a test injects.

It stands in for a replica only where a test is about what the router does with a
replica's answer, not about generating: a real ``grpc.aio`` server on a loopback
port, SERVING on grpc.health.v1, with GetModelInfo and GetLoad, and GenerateMany
answering each generation with a ``GenerationError`` carrying ``StatusReplica.code``,
as a real replica's ``serve_many`` does for a generation it refuses. With
``tokens_before`` > 0 the error comes after that many tokens (mid-stream); with
``code`` OK the generation finishes normally; ``delay_s`` makes it a slow replica. The server runs on its own event
loop in a thread, so a synchronous test can change what it injects between calls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.generate_many.server import error_event
from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc

MODEL_ID = "status-model"


class StatusReplica(inference_pb2_grpc.InferenceServicer):
    """The Inference service of a replica whose every generation ends with ``code``."""

    def __init__(self) -> None:
        self.code = grpc.StatusCode.UNAVAILABLE
        self.tokens_before = 0
        #: Seconds each answer waits before it goes out (a slow replica).
        self.delay_s = 0.0
        self.address = ""
        #: Request ids of the generations started here, in order (read from the test's thread).
        self.started: list[str] = []
        #: The ``resume_token_ids`` each of them carried: a failover resumes after the tokens sent.
        self.resumed_after: list[int] = []

    def message(self) -> str:
        return f"fake replica {self.address} says {self.code.name}"

    async def GenerateMany(
        self,
        request_iterator: AsyncIterator[inference_pb2.GenerateManyRequest],
        context: grpc.aio.ServicerContext[
            inference_pb2.GenerateManyRequest, inference_pb2.GenerateManyResponse
        ],
    ) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
        async for request in request_iterator:
            if request.WhichOneof("action") != "start":
                continue  # a cancel or pause of a generation that already ended here
            start = request.start
            self.started.append(start.request_id)
            self.resumed_after.append(len(start.resume_token_ids))
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            yield inference_pb2.GenerateManyResponse(events=self._events(request.tag, start))

    def _events(self, tag: int, start: inference_pb2.GenerateStart) -> list[inference_pb2.GenerationEvent]:
        first = len(start.resume_token_ids)
        ids = list(range(first, first + self.tokens_before))
        events = [
            inference_pb2.GenerationEvent(
                tag=tag, chunk=inference_pb2.TokenChunk(index=i, token_ids=[i], text=f" t{i}")
            )
            for i in ids
        ]
        if self.code == grpc.StatusCode.OK:
            usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=len(ids))
            done = inference_pb2.GenerationFinished(finish_reason=common_pb2.FINISH_REASON_STOP, usage=usage)
            return [*events, inference_pb2.GenerationEvent(tag=tag, finished=done)]
        return [*events, error_event(tag, self.code, self.message())]

    async def GetLoad(
        self,
        request: inference_pb2.GetLoadRequest,
        context: grpc.aio.ServicerContext[inference_pb2.GetLoadRequest, inference_pb2.LoadReport],
    ) -> inference_pb2.LoadReport:
        return inference_pb2.LoadReport()

    async def GetModelInfo(
        self,
        request: inference_pb2.GetModelInfoRequest,
        context: grpc.aio.ServicerContext[inference_pb2.GetModelInfoRequest, inference_pb2.ModelInfo],
    ) -> inference_pb2.ModelInfo:
        return inference_pb2.ModelInfo(model_id=MODEL_ID, max_context_tokens=4096, device="fake")


@contextmanager
def status_replica() -> Iterator[StatusReplica]:
    """A ``StatusReplica`` listening on 127.0.0.1 (its ``address``) until the block ends."""
    servicer = StatusReplica()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop: asyncio.Event | None = None

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
        checks = health.aio.HealthServicer()
        await checks.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        port = server.add_insecure_port("127.0.0.1:0")
        servicer.address = f"127.0.0.1:{port}"
        await server.start()
        ready.set()
        await stop.wait()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the fake replica did not start")
    try:
        yield servicer
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
