"""The `llmmesh.v1.Router` servicer: authenticates, then hands each RPC to the turn pipeline or a helper.

Thin on purpose: every turn runs through ``TurnPipeline.run_turn``; Resume is
served from the replay buffer, tasks by the task API, documents by the
retriever (with the caller's tenant set by the router, never by the client).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from services.common import errors
from services.common.ids import check_client_id
from services.gen.llmmesh.v1 import common_pb2, retriever_pb2, router_pb2, router_pb2_grpc
from services.router.admission.auth import Authenticator, Principal, downstream_metadata
from services.router.api.downstream import forward_stream, passed_on
from services.router.placement.pool import ReplicaPool
from services.router.streams.replay import ReplayBuffer
from services.router.turns.pipeline import TurnPipeline
from services.router.turns.validation import turn_request_id

if TYPE_CHECKING:
    from services.gen.llmmesh.v1.retriever_pb2_grpc import RetrieverAsyncStub

Context = grpc.aio.ServicerContext[Any, Any]
NEEDS_REDIS = "needs --redis-url: this router runs without Redis"
# No deadline reads as a huge remaining time in some gRPC versions.
NO_DEADLINE_S = 10**6


class TaskBackend(Protocol):
    """The async-task API (``task_api.TaskApi``) as the servicer calls it."""

    async def SubmitTask(
        self, principal: Principal, request: router_pb2.SubmitTaskRequest, context: Context
    ) -> router_pb2.Task: ...

    async def GetTask(
        self, principal: Principal, request: router_pb2.GetTaskRequest, context: Context
    ) -> router_pb2.Task: ...

    def WatchTask(
        self, principal: Principal, request: router_pb2.WatchTaskRequest, context: Context
    ) -> AsyncIterator[router_pb2.TaskEvent]: ...

    async def CancelTask(
        self, principal: Principal, request: router_pb2.CancelTaskRequest, context: Context
    ) -> router_pb2.Task: ...


#: Turns a Chat stream may queue behind the running one.
MAX_WAITING_TURNS = 8
#: A Chat turn's messages made ahead of the client's reading (then the turn waits).
CHAT_OUT_MESSAGES = 4


async def _until_done(
    out: asyncio.Queue[router_pb2.ChatResponse], task: asyncio.Task[None], taken: asyncio.Event
) -> AsyncIterator[router_pb2.ChatResponse]:
    """The turn's messages as ``task`` puts them, until it is done and all are taken; ``taken``
    is set each time one is."""
    while True:
        getter = asyncio.ensure_future(out.get())
        await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            taken.set()
            yield getter.result()
            continue
        getter.cancel()
        while not out.empty():
            yield out.get_nowait()
        return


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Every Router RPC."""

    def __init__(
        self,
        pipeline: TurnPipeline,
        authenticator: Authenticator,
        pool: ReplicaPool,
        policy_name: str,
        replay: ReplayBuffer | None = None,
        tasks: TaskBackend | None = None,
        retriever: RetrieverAsyncStub | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pipeline = pipeline
        self.authenticator = authenticator
        self.pool = pool
        self.policy_name = policy_name
        self.replay = replay
        self.tasks = tasks
        self.retriever = retriever
        self._clock = clock

    def _principal(self, context: Context) -> Principal:
        return self.authenticator.authenticate(context.invocation_metadata())

    def _deadline(self, context: Context) -> float | None:
        """The client's deadline on our clock: passed to every downstream call, never extended."""
        remaining = context.time_remaining()
        if remaining is None or remaining > NO_DEADLINE_S:
            return None
        return self._clock() + remaining

    async def ChatStream(
        self, request: router_pb2.ChatRequest, context: Context
    ) -> AsyncIterator[router_pb2.ChatResponse]:
        principal = self._principal(context)
        async for response in self.pipeline.run_turn(principal, request, self._deadline(context)):
            yield response

    async def Complete(
        self, request: router_pb2.ChatRequest, context: Context
    ) -> router_pb2.CompleteResponse:
        principal = self._principal(context)
        result = router_pb2.CompleteResponse()
        parts: list[str] = []
        async for response in self.pipeline.run_turn(principal, request, self._deadline(context)):
            result.request_id = response.request_id
            if response.HasField("delta"):
                parts.append(response.delta.text)
                result.token_ids.extend(response.delta.token_ids)
            else:
                result.end.CopyFrom(response.end)
        result.text = "".join(parts)
        return result

    async def Chat(
        self, request_iterator: AsyncIterator[router_pb2.ChatRequest], context: Context
    ) -> AsyncIterator[router_pb2.ChatResponse]:
        """Turns one after another; a ``cancel`` message interrupts the turn in progress.

        Bounded both ways: at most ``MAX_WAITING_TURNS`` turns wait behind the running one
        (more is RESOURCE_EXHAUSTED; 300 queued turns of 1 MB held 292 MiB of the router), and
        the answer is pulled from the pipeline only as fast as the client reads it, so the
        replica pauses for a client that stops reading, as on ChatStream (an unbounded queue
        held a whole 64k-token answer per such client: +203 MiB for ten).
        """
        principal = self._principal(context)
        deadline = self._deadline(context)
        turns: asyncio.Queue[router_pb2.ChatRequest | BaseException | None] = asyncio.Queue()
        # Each message is queued at once (a turn cancelled while it waits loses none: the
        # pipeline counts it as streamed), then the turn waits while CHAT_OUT_MESSAGES are queued.
        out: asyncio.Queue[router_pb2.ChatResponse] = asyncio.Queue()
        taken = asyncio.Event()
        running: list[asyncio.Task[None]] = []

        async def read_client() -> None:
            try:
                async for message in request_iterator:
                    if message.cancel:
                        if running and not running[0].done():
                            running[0].cancel()
                    elif turns.qsize() >= MAX_WAITING_TURNS:
                        turns.put_nowait(
                            errors.Overloaded(
                                f"at most {MAX_WAITING_TURNS} turns may wait behind the running one "
                                "on a Chat stream: send the next once an answer ends",
                                retry_after_s=1.0,
                            )
                        )
                        return
                    else:
                        turns.put_nowait(message)
            except DecodeError as exc:
                # A message that is no ChatRequest (garbage bytes, text that is not UTF-8): the
                # stream ends with a status saying so; the reader's death left the handler
                # waiting for a next turn that could never come.
                turns.put_nowait(errors.InvalidArgument("request", f"not a ChatRequest message ({exc})"))
                return
            turns.put_nowait(None)

        async def produce(
            request: router_pb2.ChatRequest,
            sent: list[router_pb2.ChatResponse],
            stopped: list[router_pb2.ChatResponse],
        ) -> None:
            turn = self.pipeline.run_turn(principal, request, deadline, on_stopped=stopped.append)
            async for response in turn:
                sent[:] = [response]
                out.put_nowait(response)
                while out.qsize() >= CHAT_OUT_MESSAGES:  # the client is not reading: wait
                    taken.clear()
                    await taken.wait()

        reader = asyncio.create_task(read_client())
        try:
            while (request := await turns.get()) is not None:
                if isinstance(request, BaseException):
                    raise request
                # Named now, not in the pipeline: a turn cancelled before it runs still ends under its id.
                request.request_id = turn_request_id(request)
                last: list[router_pb2.ChatResponse] = []  # the turn's latest message
                stopped: list[router_pb2.ChatResponse] = []  # its TurnEnd, if it stopped without one
                task = asyncio.create_task(produce(request, last, stopped))
                running[:] = [task]
                async for item in _until_done(out, task, taken):
                    yield item
                if task.cancelled():
                    # A turn whose TurnEnd is out (cancelled while it finished its bookkeeping) has
                    # ended; else the pipeline's own CANCELLED end carries the usage of what was
                    # streamed, and where; a turn cancelled before it began has none.
                    if not (last and last[0].HasField("end")):
                        yield stopped[0] if stopped else self._cancelled_early(request, last)
                elif (exc := task.exception()) is not None:
                    raise exc
        finally:
            reader.cancel()
            for task in running:
                task.cancel()

    @staticmethod
    def _cancelled_early(
        request: router_pb2.ChatRequest, last: list[router_pb2.ChatResponse]
    ) -> router_pb2.ChatResponse:
        """The CANCELLED end of a Chat turn cancelled before its pipeline ran."""
        return router_pb2.ChatResponse(
            request_id=request.request_id,
            seq=last[0].seq + 1 if last else 1,
            end=router_pb2.TurnEnd(
                finish_reason=common_pb2.FINISH_REASON_CANCELLED, session_id=request.session_id
            ),
        )

    async def Resume(
        self, request: router_pb2.ResumeRequest, context: Context
    ) -> AsyncIterator[router_pb2.ChatResponse]:
        principal = self._principal(context)
        if self.replay is None:
            raise errors.FailedPrecondition(f"Resume {NEEDS_REDIS}")
        check_client_id(request.request_id, "request_id")
        async for payload in self.replay.read_after(request.request_id, principal.tenant, request.last_seq):
            yield router_pb2.ChatResponse.FromString(payload)

    def _tasks(self) -> TaskBackend:
        if self.tasks is None:
            raise errors.FailedPrecondition(f"async tasks {NEEDS_REDIS}")
        return self.tasks

    async def SubmitTask(self, request: router_pb2.SubmitTaskRequest, context: Context) -> router_pb2.Task:
        principal = self._principal(context)
        return await self._tasks().SubmitTask(principal, request, context)

    async def GetTask(self, request: router_pb2.GetTaskRequest, context: Context) -> router_pb2.Task:
        principal = self._principal(context)
        return await self._tasks().GetTask(principal, request, context)

    async def WatchTask(
        self, request: router_pb2.WatchTaskRequest, context: Context
    ) -> AsyncIterator[router_pb2.TaskEvent]:
        principal = self._principal(context)
        async for event in self._tasks().WatchTask(principal, request, context):
            yield event

    async def CancelTask(self, request: router_pb2.CancelTaskRequest, context: Context) -> router_pb2.Task:
        principal = self._principal(context)
        return await self._tasks().CancelTask(principal, request, context)

    def _retriever(self) -> RetrieverAsyncStub:
        if self.retriever is None:
            raise errors.FailedPrecondition("documents need --retriever-addr: this router has no retriever")
        return self.retriever

    async def IngestDocument(
        self, request_iterator: AsyncIterator[retriever_pb2.IngestRequest], context: Context
    ) -> retriever_pb2.IngestSummary:
        principal = self._principal(context)
        # Pumped by us, not handed to gRPC as an iterator: an upload the retriever rejects
        # part-way must answer with the retriever's status (services/router/api/downstream.py).
        call = self._retriever().Ingest(
            None, metadata=downstream_metadata(principal), timeout=context.time_remaining()
        )
        return await forward_stream(call, request_iterator)

    async def SearchDocuments(
        self, request: retriever_pb2.SearchRequest, context: Context
    ) -> retriever_pb2.SearchResponse:
        principal = self._principal(context)
        with passed_on():
            return await self._retriever().Search(
                request, metadata=downstream_metadata(principal), timeout=context.time_remaining()
            )

    async def DeleteDocument(
        self, request: retriever_pb2.DeleteDocumentRequest, context: Context
    ) -> retriever_pb2.DeleteDocumentResponse:
        principal = self._principal(context)
        with passed_on():
            return await self._retriever().DeleteDocument(
                request, metadata=downstream_metadata(principal), timeout=context.time_remaining()
            )

    async def ListDocuments(
        self, request: retriever_pb2.ListDocumentsRequest, context: Context
    ) -> retriever_pb2.ListDocumentsResponse:
        principal = self._principal(context)
        with passed_on():
            return await self._retriever().ListDocuments(
                request, metadata=downstream_metadata(principal), timeout=context.time_remaining()
            )

    async def ListReplicas(
        self, request: router_pb2.ListReplicasRequest, context: Context
    ) -> router_pb2.ListReplicasResponse:
        self._principal(context)
        return router_pb2.ListReplicasResponse(replicas=self.pool.statuses(), policy=self.policy_name)
