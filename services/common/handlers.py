"""Rewrap a gRPC method handler so a server interceptor can run code around its behaviour."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import grpc

RunUnary = Callable[[Any, Any, Any], Awaitable[Any]]
RunStream = Callable[[Any, Any, Any], AsyncIterator[Any]]


def wrap_handler(
    handler: grpc.RpcMethodHandler, run_unary: RunUnary, run_stream: RunStream
) -> grpc.RpcMethodHandler:
    """The same RPC, with its behaviour called through ``run_unary`` / ``run_stream``.

    Both take ``(behavior, request_or_iterator, context)``; the handler's kind and its
    (de)serializers are kept. The behaviour is bound with ``functools.partial``, not
    a wrapper function: grpc.aio only streams from async generator functions, which
    ``inspect`` sees through a partial, and every streamed message would otherwise
    pass through one more generator frame.
    """
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            partial(run_unary, handler.unary_unary), handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            partial(run_unary, handler.stream_unary),
            handler.request_deserializer,
            handler.response_serializer,
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            partial(run_stream, handler.unary_stream),
            handler.request_deserializer,
            handler.response_serializer,
        )
    return grpc.stream_stream_rpc_method_handler(
        partial(run_stream, handler.stream_stream), handler.request_deserializer, handler.response_serializer
    )
