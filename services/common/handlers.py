"""Rewrap a gRPC method handler so a server interceptor can run code around its behaviour."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

RunUnary = Callable[[Any, Any, Any], Awaitable[Any]]
RunStream = Callable[[Any, Any, Any], AsyncIterator[Any]]


def wrap_handler(
    handler: grpc.RpcMethodHandler, run_unary: RunUnary, run_stream: RunStream
) -> grpc.RpcMethodHandler:
    """The same RPC, with its behaviour called through ``run_unary`` / ``run_stream``.

    Both take ``(behavior, request_or_iterator, context)``; the handler's kind and its
    (de)serializers are kept.
    """
    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def uu(request: Any, context: Any) -> Any:
            return await run_unary(inner_uu, request, context)

        return grpc.unary_unary_rpc_method_handler(
            uu, handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_unary:
        inner_su = handler.stream_unary

        async def su(request_iterator: Any, context: Any) -> Any:
            return await run_unary(inner_su, request_iterator, context)

        return grpc.stream_unary_rpc_method_handler(
            su, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream:
        inner_us = handler.unary_stream

        # Must itself be an async generator function: grpc.aio only streams from those.
        async def us(request: Any, context: Any) -> AsyncIterator[Any]:
            async for item in run_stream(inner_us, request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(
            us, handler.request_deserializer, handler.response_serializer
        )
    inner_ss = handler.stream_stream

    async def ss(request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        async for item in run_stream(inner_ss, request_iterator, context):
            yield item

    return grpc.stream_stream_rpc_method_handler(
        ss, handler.request_deserializer, handler.response_serializer
    )
