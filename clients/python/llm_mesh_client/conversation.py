"""Conversation: one open Router.Chat call carrying many turns, for blocking code (the `llm-mesh chat`
terminal). Turns and cancels go in through a queue; replies come out in order through another.

A thread reads the replies: a blocking gRPC read interrupted by Ctrl-C leaves the call unusable, so
the caller only ever waits on a queue, which Ctrl-C may interrupt safely. ``cancel()`` during a turn
makes the router end it with a "cancelled" End while the conversation stays open.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import grpc

from llm_mesh_client._gen.llmmesh.v1 import router_pb2, router_pb2_grpc
from llm_mesh_client.errors import MeshError, StreamEnded, error_from_rpc
from llm_mesh_client.events import ChatEvent, event_from
from llm_mesh_client.requests import Prompt, chat_request


class Conversation:
    """``send()`` a turn, then ``next_event()`` until its End; the next ``send()`` is the next turn."""

    def __init__(
        self,
        stub: router_pb2_grpc.RouterStub,
        metadata: tuple[tuple[str, str], ...],
        *,
        timeout: float | None = None,
    ) -> None:
        self._outbox: queue.Queue[router_pb2.ChatRequest | None] = queue.Queue()
        self._inbox: queue.Queue[router_pb2.ChatResponse | MeshError] = queue.Queue()
        # ``timeout``: the whole call's deadline (DEADLINE_EXCEEDED from next_event() after it).
        self.call = stub.Chat(iter(self._outbox.get, None), metadata=metadata, timeout=timeout)
        threading.Thread(target=self._read, name="chat-replies", daemon=True).start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self._inbox.put(reply)
            self._inbox.put(StreamEnded("the router closed the conversation"))
        except grpc.RpcError as error:
            self._inbox.put(error_from_rpc(error))

    def send(self, prompt: Prompt, **options: Any) -> None:
        """Start a turn (options as for MeshClient.chat)."""
        self._outbox.put(chat_request(prompt, **options))

    def cancel(self) -> None:
        """End the current turn now: its stream ends with a "cancelled" End."""
        self._outbox.put(router_pb2.ChatRequest(cancel=True))

    def next_event(self) -> ChatEvent:
        """The next Delta or End; raises the call's MeshError (StreamEnded: closed without one)."""
        while True:
            item = self._inbox.get()
            if isinstance(item, MeshError):
                raise item
            if (event := event_from(item)) is not None:
                return event

    def close(self) -> None:
        self._outbox.put(None)
        self.call.cancel()
