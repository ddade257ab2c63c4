"""Rewrap gRPC method handlers so code runs around their behaviour: per call, or once at registration."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from functools import partial
from typing import Any

import grpc

RunUnary = Callable[[Any, Any, Any], Awaitable[Any]]
RunStream = Callable[[Any, Any, Any], AsyncIterator[Any]]
#: Wraps the handler of one method, given its full name (``/package.Service/Method``).
MethodWrapper = Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]


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


class _WrappedGenericHandler(grpc.GenericRpcHandler):
    """A generic handler whose method handlers come out wrapped, each wrapped once."""

    def __init__(self, inner: grpc.GenericRpcHandler, wrap: MethodWrapper) -> None:
        self._inner = inner
        self._wrap = wrap
        # method -> (the inner handler, its wrapped form): reused while the inner one is the same.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None  # an unknown method is not remembered: clients choose method names
        method = handler_call_details.method
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


class HandlerWrappingServer(grpc.aio.Server):
    """A grpc.aio server whose servicers' method handlers are wrapped once, as they are registered.

    What a server interceptor does on every call (await each interceptor, look the
    handler up, wrap it again) cost the router's request path ~0.08 ms on an idle box
    (docs/router.md); wrapping each handler when it is registered does that work once.
    Everything registered through this object is wrapped: the services, health, reflection.
    """

    def __init__(self, server: grpc.aio.Server, wrap: MethodWrapper) -> None:
        self.server = server
        self._wrap = wrap

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self.server.add_generic_rpc_handlers(
            [_WrappedGenericHandler(h, self._wrap) for h in generic_rpc_handlers]
        )

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        # Generated add_*_to_server functions call this too (grpcio >= 1.63; not in the type stubs).
        self.server.add_registered_method_handlers(  # type: ignore[attr-defined]
            service_name,
            {name: self._wrap(f"/{service_name}/{name}", h) for name, h in method_handlers.items()},
        )

    def add_insecure_port(self, address: str) -> int:
        return self.server.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self.server.add_secure_port(address, server_credentials)

    async def start(self) -> None:
        await self.server.start()

    async def stop(self, grace: float | None = None) -> None:
        await self.server.stop(grace)

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self.server.wait_for_termination(timeout)
