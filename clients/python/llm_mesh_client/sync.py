"""SyncMeshClient: the same calls for code without an event loop (scripts, the llm-mesh CLI).

A thin layer over the blocking grpc channel that shares MeshClient's request builders, events
and errors. A turn streams over Router.ChatStream; leaving the loop (or Ctrl-C) cancels it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from llm_mesh_client._gen.llmmesh.v1 import retriever_pb2, router_pb2, router_pb2_grpc
from llm_mesh_client.conversation import Conversation
from llm_mesh_client.errors import MeshError, StreamEnded, Unavailable, error_from_rpc
from llm_mesh_client.events import ChatEvent, Completion, End, event_from
from llm_mesh_client.requests import Prompt, call_metadata, channel_credentials, chat_request, document_source


class SyncMeshClient:
    """Blocking twin of MeshClient (same arguments); use as a context manager."""

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
        credentials = channel_credentials(tls)
        self._channel = (
            grpc.secure_channel(address, credentials)
            if credentials is not None
            else grpc.insecure_channel(address)
        )
        self.stub = router_pb2_grpc.RouterStub(self._channel)

    def __enter__(self) -> SyncMeshClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Unavailable if no connection to the router opens within ``timeout``."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"no router answered at {self.address} within {timeout:g} s") from None

    def _options(self, timeout: float | None) -> dict[str, Any]:
        return {"metadata": self._metadata, "timeout": timeout if timeout is not None else self.timeout}

    def conversation(self, *, timeout: float | None = None) -> Conversation:
        """A Router.Chat call for many turns, with cancel that keeps it open (see Conversation).
        ``timeout`` (default: the client's) is the deadline of the whole call, every turn in it."""
        return Conversation(
            self.stub, self._metadata, timeout=timeout if timeout is not None else self.timeout
        )

    def chat(self, prompt: Prompt, *, timeout: float | None = None, **options: Any) -> Iterator[ChatEvent]:
        """Delta… then one End; leaving the loop early cancels the call."""
        call = self.stub.ChatStream(chat_request(prompt, **options), **self._options(timeout))
        ended = False
        try:
            for reply in call:
                event = event_from(reply)
                ended = isinstance(event, End)
                if event is not None:
                    yield event
                if ended:
                    return
            raise StreamEnded("the router closed the stream before the turn's end")
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        finally:
            if not ended:
                # Left before the end (break, Ctrl-C): the router cancels the generation.
                call.cancel()

    def complete(self, prompt: Prompt, *, timeout: float | None = None, **options: Any) -> Completion:
        reply = self._unary(self.stub.Complete, chat_request(prompt, **options), timeout)
        return Completion(reply.text, reply.end, reply.request_id, list(reply.token_ids))

    def submit_task(
        self, prompt: Prompt, *, idempotency_key: str = "", timeout: float | None = None, **options: Any
    ) -> router_pb2.Task:
        request = router_pb2.SubmitTaskRequest(
            request=chat_request(prompt, **options), idempotency_key=idempotency_key
        )
        task: router_pb2.Task = self._unary(self.stub.SubmitTask, request, timeout)
        return task

    def get_task(self, task_id: str, *, timeout: float | None = None) -> router_pb2.Task:
        task: router_pb2.Task = self._unary(
            self.stub.GetTask, router_pb2.GetTaskRequest(task_id=task_id), timeout
        )
        return task

    def ingest(
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
                summary: retriever_pb2.IngestSummary = self._unary(self.stub.IngestDocument, pieces, timeout)
            except MeshError:
                # gRPC fails the call with UNKNOWN "Exception iterating requests!": say why instead.
                if pieces.error is not None:
                    raise pieces.error from None
                raise
        return summary

    def list_replicas(self, *, timeout: float | None = None) -> router_pb2.ListReplicasResponse:
        pool: router_pb2.ListReplicasResponse = self._unary(
            self.stub.ListReplicas, router_pb2.ListReplicasRequest(), timeout
        )
        return pool

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, **self._options(timeout))
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
