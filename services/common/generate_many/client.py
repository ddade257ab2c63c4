"""The client half of ``Inference.GenerateMany`` (the router's): all of a replica's generations over one stream.

One long-lived stream per replica carries every generation the router runs
there; the replica sends one message per engine step with every generation's
new tokens, so the router reads one gRPC message per step instead of one per
generation per step (grpc-python pays tens of microseconds per message). A
reader task hands each event to its generation's ``GenerationHandle``; whatever
reached a handle while its consumer was busy writing to the client comes back
as one batch, so a slow client gets fewer, larger messages. A generation whose
consumer falls ``PAUSE_AFTER_TOKENS`` behind is paused on the replica until it
catches up: one slow client must not fill the router with its answer, nor slow
the stream every other generation shares.

If the stream breaks (the replica died, the network dropped), every generation
on it fails at once with ``StreamBroken`` and the next ``open`` dials a new one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING

import grpc

from services.common import errors, tracing
from services.common.eager import run_eagerly
from services.common.generate_many.limits import MAX_START_BYTES, MERGE_PENDING_AFTER, PAUSE_AFTER_TOKENS
from services.common.generate_many.merge import merge
from services.gen.llmmesh.v1 import inference_pb2

if TYPE_CHECKING:
    from services.gen.llmmesh.v1.inference_pb2_grpc import InferenceAsyncStub

log = logging.getLogger("llmmesh.generate_many.client")


class StreamBroken(Exception):
    """The GenerateMany stream a generation ran on ended before the generation did."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class GenerationHandle:
    """One generation on a shared stream: its events as they arrive, in batches."""

    __slots__ = ("_connection", "_events", "_failure", "_paused", "_waiter", "done", "tag")

    def __init__(self, connection: _Connection, tag: int) -> None:
        self._connection = connection
        self.tag = tag
        self._events: list[inference_pb2.GenerationEvent] = []
        self._waiter: asyncio.Future[None] | None = None
        self._failure: BaseException | None = None
        #: Whether the replica was asked to hold this generation's events back.
        self._paused = False
        #: Set once the generation's last event (finished or error) arrived: nothing to cancel.
        self.done = False

    async def events(self) -> list[inference_pb2.GenerationEvent]:
        """Every event that arrived since the last call (waits for one); then the failure, if any."""
        while not self._events:
            if self._failure is not None:
                raise self._failure
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        events = self._events
        self._events = []
        if self._paused:
            self._paused = False
            if not self.done:
                self._connection.send(
                    inference_pb2.GenerateManyRequest(tag=self.tag, resume=inference_pb2.ResumeGeneration())
                )
        return events

    def fail(self, failure: BaseException) -> None:
        """End this generation for its consumer with ``failure`` (after the events already here),
        and stop it on the replica."""
        self._wake_with(failure)
        self.close()

    def close(self) -> None:
        """The consumer is done: cancel the generation on the replica unless it already ended."""
        if self._connection.handles.pop(self.tag, None) is not None and not self.done:
            self._connection.send(
                inference_pb2.GenerateManyRequest(tag=self.tag, cancel=inference_pb2.CancelGeneration())
            )

    def _deliver(self, event: inference_pb2.GenerationEvent) -> None:
        events = self._events
        events.append(event)
        if len(events) >= MERGE_PENDING_AFTER:
            self._merge_pending()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _merge_pending(self) -> None:
        """The chunks waiting for the consumer as one chunk (numbered from the first), then the end if any."""
        events = self._events
        last = [events.pop()] if events[-1].WhichOneof("event") != "chunk" else []
        merged = inference_pb2.TokenChunk()
        merged.index, merged.text = merge([e.chunk for e in events], merged.token_ids)
        for e in events:  # one per token id, in the same order (empty unless asked for)
            merged.logprobs.extend(e.chunk.logprobs)
            merged.prompt_logprobs.extend(e.chunk.prompt_logprobs)  # the first chunk's, if asked for
            merged.prompt_text += e.chunk.prompt_text  # likewise
            merged.prompt_tokens = max(merged.prompt_tokens, e.chunk.prompt_tokens)  # likewise
        self._events = [inference_pb2.GenerationEvent(tag=self.tag, chunk=merged), *last]
        if len(merged.token_ids) >= PAUSE_AFTER_TOKENS and not self._paused and not last:
            self._paused = True
            self._connection.send(
                inference_pb2.GenerateManyRequest(tag=self.tag, pause=inference_pb2.PauseGeneration())
            )

    def _wake_with(self, failure: BaseException) -> None:
        if self._failure is None:
            self._failure = failure
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Connection:
    """One GenerateMany call: its writer, its reader, the generations on it."""

    def __init__(self, stub: InferenceAsyncStub, address: str) -> None:
        self.address = address
        self.handles: dict[int, GenerationHandle] = {}
        self.broken: StreamBroken | None = None
        self._outbox: list[inference_pb2.GenerateManyRequest] = []
        #: Whether ``_write`` is running (grpc aio allows one write in flight per call).
        self._writing = False
        self._call = stub.GenerateMany()  # type: ignore[call-arg]
        self._reader = asyncio.create_task(self._read())

    def send(self, request: inference_pb2.GenerateManyRequest) -> None:
        if self.broken is not None:
            return
        self._outbox.append(request)
        if not self._writing:
            # Started here, not in a task: an idle stream's write goes out before send returns.
            self._writing = True
            run_eagerly(self._write(), self._written)

    async def _write(self) -> None:
        """Everything in the outbox, in order, one write at a time, until it is empty."""
        while self._outbox:
            batch = self._outbox[:]
            self._outbox.clear()
            for request in batch:
                await self._call.write(request)

    def _written(self, failure: BaseException | None) -> None:
        self._writing = False
        if failure is not None:
            # The call failed (or was cancelled by close): the reader sees it and fails the generations.
            log.debug("GenerateMany write to %s failed: %r", self.address, failure)
            self._outbox.clear()
            self._call.cancel()

    async def _read(self) -> None:
        failure = StreamBroken(grpc.StatusCode.UNAVAILABLE, f"replica {self.address} ended the stream")
        try:
            handles = self.handles
            async for response in self._call:
                for event in response.events:
                    handle = handles.get(event.tag)
                    if handle is None:
                        continue  # cancelled by the router: its last events are dropped
                    if event.WhichOneof("event") != "chunk":
                        handle.done = True
                        del handles[event.tag]
                    handle._deliver(event)
        except grpc.aio.AioRpcError as exc:
            failure = StreamBroken(exc.code(), exc.details() or exc.code().name)
        except asyncio.CancelledError:
            failure = StreamBroken(grpc.StatusCode.CANCELLED, "the router closed the stream")
            raise
        finally:
            self.broken = failure
            self._outbox.clear()
            for handle in list(self.handles.values()):
                handle._wake_with(failure)
            self.handles.clear()

    async def close(self) -> None:
        self._call.cancel()  # a write in flight fails with it
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class ReplicaMultiplexer:
    """A replica's GenerateMany stream, dialled when first needed and again after it breaks."""

    def __init__(self, stub: InferenceAsyncStub, address: str) -> None:
        self._stub = stub
        self._address = address
        self._tags = itertools.count(1)
        self._connection: _Connection | None = None

    def open(self, start: inference_pb2.GenerateStart, timeout_s: float | None) -> GenerationHandle:
        """Start a generation; its events come through the handle. ``InvalidArgument`` for one
        too big for a message: sent, it would end the shared stream of every other generation."""
        size = start.ByteSize()
        if size > MAX_START_BYTES:
            raise errors.InvalidArgument(
                "prompt",
                f"the request to the model is {size:,} bytes (prompt, history and context), "
                f"more than the {MAX_START_BYTES:,} one message carries",
            )
        connection = self._connection
        if connection is None or connection.broken is not None:
            with tracing.detached():  # the stream outlives this request: it must not carry its trace
                connection = self._connection = _Connection(self._stub, self._address)
        tag = next(self._tags)
        handle = connection.handles[tag] = GenerationHandle(connection, tag)
        connection.send(
            inference_pb2.GenerateManyRequest(
                tag=tag, start=start, timeout_s=timeout_s or 0.0, traceparent=tracing.current_traceparent()
            )
        )
        return handle

    @property
    def generations(self) -> int:
        """Generations running on the current stream."""
        return 0 if self._connection is None else len(self._connection.handles)

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()
