"""MeshClient: the router's API over grpc.aio, typed, with errors as MeshError subclasses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import grpc.aio

from llm_mesh_client._gen.llmmesh.v1 import retriever_pb2, router_pb2, router_pb2_grpc
from llm_mesh_client.errors import MeshError, StreamEnded, Unavailable, error_from_rpc
from llm_mesh_client.events import ChatEvent, Completion, Delta, End, event_from
from llm_mesh_client.requests import Prompt, call_metadata, channel_credentials, chat_request, document_source


class ChatTurn:
    """One turn's stream: ``async for event in turn`` yields Delta… then one End.

    The turn's request is sent once, when the turn is first read. Reading it again (another
    ``async for``, or ``collect()`` after reading some events with ``__anext__()``) goes on where
    the last read stopped, on the same call: nothing is asked twice. ``collect()`` returns the
    whole answer, the Deltas already read included.

    Leaving the loop early (break, an exception, the ``async with`` block's end) cancels the call,
    and the router stops generating. ``await turn.cancel()`` instead asks the router to end the
    turn: the stream then ends with an End whose finish_reason is "cancelled" (on a ``chat()``
    turn; a ``resume()`` stream has nothing to cancel but the call).

    ``request_id`` and ``last_seq`` are where the turn stands, for ``resume()``: from the start the
    request id given to ``chat(request_id=…)`` or ``resume()`` (and ``resume()``'s ``last_seq``),
    then those of the last message read. A ``chat()`` without a request id learns the one the
    router gives it with the first message.
    """

    def __init__(
        self,
        call: Any,
        first: router_pb2.ChatRequest | None = None,
        *,
        request_id: str = "",
        last_seq: int = 0,
    ) -> None:
        self._call = call
        self._first = first
        self._first_sent = False
        self.request_id = request_id or (first.request_id if first is not None else "")
        #: The seq of the last message read: pass it to `resume()` after a dropped connection.
        self.last_seq = last_seq
        self.end: End | None = None
        self._parts: list[str] = []
        self._token_ids: list[int] = []

    async def __aenter__(self) -> ChatTurn:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.end is None:
            self.close()

    def __aiter__(self) -> AsyncIterator[ChatEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[ChatEvent]:
        if self.end is not None:
            return  # read to its end already
        try:
            if self._first is not None and not self._first_sent:
                self._first_sent = True  # before the write: a failed write is not retried either
                await self._call.write(self._first)
            while True:
                reply = await self._call.read()
                if reply is grpc.aio.EOF:  # type: ignore[attr-defined]  # (missing from grpc-stubs)
                    raise StreamEnded("the router closed the stream before the turn's end")
                event = event_from(reply)
                self.request_id, self.last_seq = reply.request_id, reply.seq
                if isinstance(event, Delta):
                    self._parts.append(event.text)
                    self._token_ids += event.token_ids
                    yield event
                elif isinstance(event, End):
                    self.end = event
                    if self._first is not None:
                        # Half-close: the router ends the call by itself, nothing is cancelled.
                        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                            await self._call.done_writing()
                    yield event
                    return
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from error
        finally:
            if self.end is None:
                # Left before the end (break, an exception): the router cancels the generation.
                self.close()

    async def cancel(self) -> None:
        """Ask the router to end the turn now (chat turns); the stream ends with a "cancelled" End."""
        if self._first is None:
            self.close()
            return
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError):
            await self._call.write(router_pb2.ChatRequest(cancel=True))

    def close(self) -> None:
        """Cancel the call if it is still open (the router cancels the generation)."""
        self._call.cancel()

    async def collect(self) -> Completion:
        """Read the turn to its end; the Completion holds every Delta of the stream, those read
        before ``collect()`` included (a ``resume()`` stream: those after its ``last_seq``)."""
        async for _ in self:
            pass
        if self.end is None:  # pragma: no cover  (the iteration raises StreamEnded first)
            raise StreamEnded("the router closed the stream before the turn's end")
        return Completion("".join(self._parts), self.end.turn, self.end.request_id, list(self._token_ids))


class MeshClient:
    """A client of one router. Use as ``async with MeshClient("127.0.0.1:50051") as mesh: …``.

    ``api_key`` is sent as `authorization: Bearer KEY`; ``tls`` is None (plaintext), True (the
    system's roots) or grpc.ChannelCredentials (e.g. ``grpc.ssl_channel_credentials(ca)``).
    """

    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        tls: bool | grpc.ChannelCredentials | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = call_metadata(api_key)
        self._credentials = channel_credentials(tls)
        # The grpc.aio channel belongs to the event loop it is made in: it is made on first use,
        # inside the running loop, so a client built before `asyncio.run()` works in it.
        self._channel: grpc.aio.Channel | None = None
        self._stub: router_pb2_grpc.RouterAsyncStub | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _connect(self) -> tuple[grpc.aio.Channel, router_pb2_grpc.RouterAsyncStub]:
        """The channel and its stub, made in the running loop on first use (or again when the
        loop they were made in is not the running one: e.g. a second ``asyncio.run()``)."""
        loop = asyncio.get_running_loop()
        if self._channel is None or self._stub is None or self._loop is not loop:
            self._channel = (
                grpc.aio.secure_channel(self.address, self._credentials)
                if self._credentials is not None
                else grpc.aio.insecure_channel(self.address)
            )
            self._stub, self._loop = router_pb2_grpc.RouterStub(self._channel), loop
        return self._channel, self._stub

    @property
    def stub(self) -> router_pb2_grpc.RouterAsyncStub:
        """The generated Router stub over this client's channel (needs a running event loop)."""
        return self._connect()[1]

    async def __aenter__(self) -> MeshClient:
        self._connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        channel, loop = self._channel, self._loop
        self._channel = self._stub = self._loop = None
        if channel is not None and loop is asyncio.get_running_loop():
            await channel.close(None)

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until a connection to the router is open; Unavailable if none within ``timeout``."""
        channel, _ = self._connect()
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout)
        except TimeoutError:
            raise Unavailable(f"no router answered at {self.address} within {timeout:g} s") from None

    def _options(self, timeout: float | None) -> dict[str, Any]:
        return {"metadata": self._metadata, "timeout": timeout if timeout is not None else self.timeout}

    def chat(self, prompt: Prompt, *, timeout: float | None = None, **options: Any) -> ChatTurn:
        """Stream one turn (Router.Chat). ``options``: model, session_id, session_must_exist,
        max_tokens, temperature, rag, request_id, ignore_eos (see requests.chat_request)."""
        request = chat_request(prompt, **options)
        return ChatTurn(self.stub.Chat(**self._options(timeout)), first=request)

    async def complete(self, prompt: Prompt, *, timeout: float | None = None, **options: Any) -> Completion:
        """One whole answer (Router.Complete)."""
        request = chat_request(prompt, **options)
        try:
            reply = await self.stub.Complete(request, **self._options(timeout))
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from error
        return Completion(reply.text, reply.end, reply.request_id, list(reply.token_ids))

    def resume(self, request_id: str, last_seq: int = 0, *, timeout: float | None = None) -> ChatTurn:
        """The turn's messages after ``last_seq``, then live ones until its end (Router.Resume)."""
        request = router_pb2.ResumeRequest(request_id=request_id, last_seq=last_seq)
        return ChatTurn(
            self.stub.Resume(request, **self._options(timeout)), request_id=request_id, last_seq=last_seq
        )

    async def submit_task(
        self, prompt: Prompt, *, idempotency_key: str = "", timeout: float | None = None, **options: Any
    ) -> router_pb2.Task:
        """Queue a turn as a task (the router needs --redis-url); returns it QUEUED."""
        request = router_pb2.SubmitTaskRequest(
            request=chat_request(prompt, **options), idempotency_key=idempotency_key
        )
        return await self._unary(self.stub.SubmitTask, request, timeout)

    async def get_task(self, task_id: str, *, timeout: float | None = None) -> router_pb2.Task:
        return await self._unary(self.stub.GetTask, router_pb2.GetTaskRequest(task_id=task_id), timeout)

    async def cancel_task(self, task_id: str, *, timeout: float | None = None) -> router_pb2.Task:
        return await self._unary(self.stub.CancelTask, router_pb2.CancelTaskRequest(task_id=task_id), timeout)

    async def watch_task(
        self, task_id: str, *, timeout: float | None = None
    ) -> AsyncIterator[router_pb2.TaskEvent]:
        """The task's state now and on each change, with its tokens as they come, until it ends."""
        call = self.stub.WatchTask(router_pb2.WatchTaskRequest(task_id=task_id), **self._options(timeout))
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from error
        finally:
            call.cancel()

    async def ingest(
        self,
        source: str | Path | bytes,
        *,
        document_id: str | None = None,
        title: str | None = None,
        mime_type: str = "",
        metadata: dict[str, str] | None = None,
        filename: str = "",
        timeout: float | None = None,
    ) -> retriever_pb2.IngestSummary:
        """Send one document (a path, or bytes with document_id and mime_type or filename) to
        the API key's tenant through the router. ``summary.unchanged``: it was already there."""
        document = document_source(
            source,
            document_id=document_id,
            title=title,
            mime_type=mime_type,
            metadata=metadata,
            filename=filename,
        )
        with document.open() as pieces:  # an unreadable file raises its OSError here
            try:
                return await self._unary(self.stub.IngestDocument, pieces, timeout)
            except (MeshError, asyncio.CancelledError):
                # grpc.aio cancels the call when the request iterator raises: say why instead.
                if pieces.error is not None:
                    raise pieces.error from None
                raise

    async def list_replicas(self, *, timeout: float | None = None) -> router_pb2.ListReplicasResponse:
        return await self._unary(self.stub.ListReplicas, router_pb2.ListReplicasRequest(), timeout)

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, **self._options(timeout))
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from error
