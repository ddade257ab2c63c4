"""The server half of ``Inference.GenerateMany`` (a replica's), and ``Generate`` on the same path.

A router relays every token twice (replica → router → client), and in grpc-python
each gRPC message costs tens of microseconds of CPU however small it is. On a
``Generate`` stream per request, an engine step with 200 running sequences is 200
messages into the router; here it is one: every generation's task appends its
events to a shared outbox and one writer sends whatever the outbox holds as a
single ``GenerateManyResponse``. Whatever piled up while the previous message was
being written goes out together, so a busy stream batches more, never waits.

It knows no engine: a replica hands it a ``GenerationBackend`` (the inference
engine's servicer, or the synthetic token source), so both serve the very same
stream. ``Generate``, the public single-generation RPC, runs through the same
backend call and the same request-id rule (``serve_one``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import grpc
from opentelemetry.trace import Status as SpanStatus
from opentelemetry.trace import StatusCode as SpanStatusCode

from services.common import tracing
from services.common.errors import InvalidArgument, RequestFault
from services.common.generate_many.limits import MESSAGE_BUDGET_BYTES, OUTBOX_EVENTS
from services.common.grpc_status import status_for
from services.gen.llmmesh.v1 import inference_pb2

log = logging.getLogger("llmmesh.generate_many.server")

#: No deadline reads as a huge remaining time in some gRPC versions.
NO_DEADLINE_S = 1e6


class GenerationBackend(Protocol):
    """What serves one generation: the engine, or the synthetic token source."""

    def generate(
        self, start: inference_pb2.GenerateStart, timeout_s: float
    ) -> AsyncGenerator[inference_pb2.GenerationEvent, None]:
        """The generation's events (chunks, then ``finished``), tag unset; raises a MeshError to refuse it.

        ``timeout_s`` (0 = none) is enforced by the caller; it is passed for the logs.
        Leaving the iterator early must stop the generation.
        """
        ...

    def cancel(self, request_id: str) -> None:
        """End the running generation ``request_id`` at its next step (it then finishes CANCELLED)."""
        ...


def with_request_id(start: inference_pb2.GenerateStart) -> str:
    """The generation's request id: the caller's, else one minted here (in ``start``).

    The router mints a turn's id once, at its edge, and every hop carries it to the
    engine unchanged; a replica mints one only for a direct client that sent none.
    """
    if not start.request_id:
        start.request_id = uuid.uuid4().hex
    return start.request_id


def take_batch(outbox: list[inference_pb2.GenerationEvent]) -> list[inference_pb2.GenerationEvent]:
    """The events of the next message, oldest first, at most ``MESSAGE_BUDGET_BYTES`` (at least one)."""
    size = 0
    for i, event in enumerate(outbox):
        size += event.ByteSize() + 8  # plus the field's tag and length prefix
        if size > MESSAGE_BUDGET_BYTES and i > 0:
            batch = outbox[:i]
            del outbox[:i]
            return batch
    batch = outbox[:]
    outbox.clear()
    return batch


def error_event(
    tag: int, code: grpc.StatusCode, message: str, request_fault: bool = False
) -> inference_pb2.GenerationEvent:
    return inference_pb2.GenerationEvent(
        tag=tag,
        error=inference_pb2.GenerationError(code=code.value[0], message=message, request_fault=request_fault),
    )


async def serve_many(
    backend: GenerationBackend,
    requests: AsyncIterator[inference_pb2.GenerateManyRequest],
    stopping: asyncio.Event | None = None,
) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
    """One GenerateMany stream: start, cancel, pause and resume generations as asked, send their
    events in batches.

    The stream ends once the client has half-closed, or ``stopping`` is set (the
    replica drains: the backend refuses new generations), and every generation
    on it ended; if the client goes away, every generation on it is stopped.
    A long-lived stream must not hold a draining server for its whole grace period.
    """
    outbox: list[inference_pb2.GenerationEvent] = []
    wake = asyncio.Event()
    #: tag → (task, request id) of each running generation.
    running: dict[int, tuple[asyncio.Task[None], str]] = {}
    #: tag → the gate a paused generation waits at (set on resume): its consumer fell behind.
    paused: dict[int, asyncio.Event] = {}

    #: Set while the outbox has room (``OUTBOX_EVENTS``): generations wait for it to put more in.
    room = asyncio.Event()
    room.set()

    def emit(event: inference_pb2.GenerationEvent) -> None:
        outbox.append(event)
        if len(outbox) >= OUTBOX_EVENTS:
            room.clear()
        wake.set()

    async def run_one(tag: int, request: inference_pb2.GenerateManyRequest) -> None:
        start, timeout_s = request.start, request.timeout_s
        with tracing.generation_span(request.traceparent, **{"llmmesh.request_id": start.request_id}) as span:
            try:
                async with asyncio.timeout(timeout_s if timeout_s > 0 else None):
                    events = backend.generate(start, timeout_s)
                    try:
                        async for event in events:
                            event.tag = tag
                            emit(event)
                            if span is not None:
                                tracing.record_stage_spans(span, event, time.time_ns())
                            gate = paused.get(tag)
                            if gate is not None:
                                await gate.wait()  # the backend's next events wait in its own queue
                            if not room.is_set():
                                await room.wait()  # the router is behind on the whole stream
                    finally:
                        await events.aclose()  # stops the generation when it did not finish
            except TimeoutError:
                message = f"generation took over {timeout_s:g} s"
                emit(error_event(tag, grpc.StatusCode.DEADLINE_EXCEEDED, message))
                if span is not None:
                    span.set_status(SpanStatus(SpanStatusCode.ERROR, message))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # one generation's failure is its own, never the stream's
                code = status_for(exc)
                fault = isinstance(exc, RequestFault)  # the engine logged it, with the row's cause
                if code == grpc.StatusCode.INTERNAL and not fault:
                    log.exception("generation %s failed", start.request_id)
                emit(error_event(tag, code, str(exc) or type(exc).__name__, request_fault=fault))
                if span is not None:
                    span.set_status(SpanStatus(SpanStatusCode.ERROR, str(exc) or type(exc).__name__))

    def forget(tag: int, task: asyncio.Task[None]) -> None:
        entry = running.get(tag)
        if entry is not None and entry[0] is task:
            del running[tag]
            paused.pop(tag, None)
        wake.set()

    def release(tag: int) -> None:
        gate = paused.pop(tag, None)
        if gate is not None:
            gate.set()

    async def read() -> None:
        async for request in requests:
            action = request.WhichOneof("action")
            tag = request.tag
            if action == "start":
                if tag in running:
                    emit(error_event(tag, grpc.StatusCode.INVALID_ARGUMENT, f"tag {tag} is already running"))
                    continue
                request_id = with_request_id(request.start)
                task = asyncio.create_task(run_one(tag, request))
                running[tag] = (task, request_id)
                task.add_done_callback(functools.partial(forget, tag))
            elif action == "cancel":
                entry = running.get(tag)
                if entry is not None:
                    backend.cancel(entry[1])
                    release(tag)  # a paused generation must reach its CANCELLED end to free its task
            elif action == "pause":
                if tag in running and tag not in paused:
                    paused[tag] = asyncio.Event()
            elif action == "resume":
                release(tag)
            else:
                emit(
                    error_event(
                        tag,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "a request needs `start`, `cancel`, `pause` or `resume`",
                    )
                )
        # Half-closed: no `resume` can come any more, so nothing stays paused (the stream would hang).
        for tag in list(paused):
            release(tag)

    reader = asyncio.create_task(read())
    reader.add_done_callback(lambda _: wake.set())
    watcher: asyncio.Task[bool] | None = None
    if stopping is not None:
        watcher = asyncio.create_task(stopping.wait())
        watcher.add_done_callback(lambda _: wake.set())
    try:
        while True:
            if outbox:
                batch = take_batch(outbox)
                if len(outbox) < OUTBOX_EVENTS:
                    room.set()
                yield inference_pb2.GenerateManyResponse(events=batch)
                continue
            if stopping is not None and stopping.is_set() and not running:
                return  # drained: the router sees the end and sends new work elsewhere
            if reader.done() and not running:
                if not reader.cancelled() and (exc := reader.exception()) is not None:
                    if isinstance(exc, grpc.RpcError):
                        return  # the client went away; nothing is left to tell it
                    raise exc
                return
            await wake.wait()
            wake.clear()
    finally:
        tasks: list[asyncio.Task[Any]] = [reader, *(task for task, _ in running.values())]
        if watcher is not None:
            tasks.append(watcher)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve_one(
    backend: GenerationBackend,
    requests: AsyncIterator[inference_pb2.GenerateRequest],
    context: grpc.aio.ServicerContext[Any, Any],
) -> AsyncIterator[inference_pb2.GenerateResponse]:
    """One ``Generate`` call: the backend's generation of its `start`, as GenerateResponses.

    The same backend call as a GenerateMany generation, with the call's deadline (which
    gRPC enforces) passed for the logs; a later `cancel` ends it. A refusal is raised, so
    the call ends with its status, as a unary-start RPC should.
    """
    first = await anext(aiter(requests), None)
    if first is None:
        raise InvalidArgument("start", "the stream ended before a start message")
    if first.WhichOneof("action") != "start":
        raise InvalidArgument("start", "the first message must be `start`")
    start = first.start
    request_id = with_request_id(start)
    remaining = context.time_remaining()
    timeout_s = 0.0 if remaining is None or remaining > NO_DEADLINE_S else remaining
    watcher = asyncio.create_task(_watch_for_cancel(requests, backend, request_id))
    events = backend.generate(start, timeout_s)
    try:
        async for event in events:
            kind = event.WhichOneof("event")
            if kind == "chunk":
                yield inference_pb2.GenerateResponse(chunk=event.chunk)
            elif kind == "finished":
                yield inference_pb2.GenerateResponse(finished=event.finished)
    finally:
        watcher.cancel()
        await events.aclose()  # stops the generation when it did not finish


async def _watch_for_cancel(
    requests: AsyncIterator[inference_pb2.GenerateRequest], backend: GenerationBackend, request_id: str
) -> None:
    """A later `cancel` message ends the generation (the stream then reports CANCELLED)."""
    try:
        async for message in requests:
            if message.WhichOneof("action") == "cancel":
                backend.cancel(request_id)
                return
    except grpc.RpcError:
        # The client went away; the handler's own cancellation stops the generation.
        return
