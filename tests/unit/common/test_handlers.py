"""Handlers wrapped once at registration: the error mapping without a per-call interceptor."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from services.common import errors
from services.common.handlers import HandlerWrappingServer
from services.common.metrics import REQUESTS
from services.common.server import error_mapping
from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc


class Echo(router_pb2_grpc.RouterServicer):
    """ChatStream echoes the last message's words; an empty message is bad input."""

    async def ChatStream(
        self, request: router_pb2.ChatRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[router_pb2.ChatResponse]:
        words = request.messages[-1].content.split()
        if not words:
            raise errors.InvalidArgument("messages[0].content", "must not be empty")
        if words[0] == "lookup":  # an error that echoes the client's input, as NOT_FOUND ones do
            raise errors.NotFound(f"messages[0].content: no thing {request.messages[-1].content!r}")
        for seq, word in enumerate(words, 1):
            yield router_pb2.ChatResponse(seq=seq, delta=router_pb2.TokenDelta(text=word))


def chat(text: str) -> router_pb2.ChatRequest:
    return router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content=text)])


async def test_each_method_is_wrapped_once_and_errors_still_become_statuses() -> None:
    wrapped: list[str] = []
    mapping = error_mapping("handlers-test")

    def counting(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        wrapped.append(method)
        return mapping(method, handler)

    server = HandlerWrappingServer(grpc.aio.server(), counting)
    router_pb2_grpc.add_RouterServicer_to_server(Echo(), server)  # type: ignore[abstract]
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            router = router_pb2_grpc.RouterStub(channel)  # type: ignore[no-untyped-call]
            words = [r.delta.text async for r in router.ChatStream(chat("one two three"))]
            assert words == ["one", "two", "three"]
            after_first_call = len(wrapped)
            for _ in range(5):
                assert len([r async for r in router.ChatStream(chat("again"))]) == 1
            # Wrapped when registered (and at most once more, lazily, through the generic handler):
            # never again per call, as an interceptor would.
            assert len(wrapped) == after_first_call
            assert wrapped.count("/llmmesh.v1.Router/ChatStream") in (1, 2)

            # The error mapping is in place: bad input is INVALID_ARGUMENT naming the field.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in router.ChatStream(chat("   ")):
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "messages[0].content" in (refused.value.details() or "")
            assert REQUESTS.labels("handlers-test", "ChatStream", "INVALID_ARGUMENT")._value.get() == 1

            # Health is registered through the same server, so it is wrapped (and counted) too.
            checks = REQUESTS.labels("handlers-test", "Check", "OK")._value.get()
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())  # type: ignore[no-untyped-call]
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert REQUESTS.labels("handlers-test", "Check", "OK")._value.get() == checks + 1
    finally:
        await server.stop(None)


async def test_a_status_echoing_a_huge_input_is_cut_and_still_reaches_the_client() -> None:
    """Echoed whole, a 20 KB input made the status larger than gRPC's 8 KiB metadata limit: the
    client got RESOURCE_EXHAUSTED ("metadata size exceeds soft limit") instead of NOT_FOUND."""
    server = HandlerWrappingServer(grpc.aio.server(), error_mapping("handlers-test"))
    router_pb2_grpc.add_RouterServicer_to_server(Echo(), server)  # type: ignore[abstract]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            router = router_pb2_grpc.RouterStub(channel)  # type: ignore[no-untyped-call]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in router.ChatStream(chat("lookup " + "x" * 20_000)):
                    pass
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            details = refused.value.details() or ""
            assert details.startswith("messages[0].content: no thing 'lookup xxx")
            assert details.endswith("(message cut)") and len(details) < 1100
    finally:
        await server.stop(None)


def test_a_message_that_is_not_its_proto_is_the_clients_invalid_argument() -> None:
    """A GenerateStart whose prompt is not UTF-8 ended Generate (and a whole GenerateMany
    stream) with INTERNAL: DecodeError is no ValueError."""
    from google.protobuf.message import DecodeError

    from services.gen.llmmesh.v1 import inference_pb2

    with pytest.raises(DecodeError) as raised:
        inference_pb2.GenerateStart.FromString(b"\x1a\x02\xff\xfe")  # field 3 (prompt): bad UTF-8
    assert errors.code_for(raised.value) == errors.Code.INVALID_ARGUMENT
