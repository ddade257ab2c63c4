"""The server side of tracing: one SERVER span per RPC, continuing the caller's trace from its metadata."""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from services.common.handlers import wrap_handler
from services.common.tracing import (
    SHARED_STREAM_METHOD,
    enabled,
    extract_context,
    mark_failed,
    record_stage_spans,
    tracer,
)


class ServerTracingInterceptor(grpc.aio.ServerInterceptor):
    """Continues the caller's trace: one SERVER span per RPC, with stage spans from final timings."""

    def __init__(self, service: str) -> None:
        self._service = service

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        full_method = handler_call_details.method
        # Health checks and reflection would drown every real trace; a GenerateMany stream outlives
        # the requests on it, so each generation gets its own span instead (``generation_span``).
        if (
            handler is None
            or not enabled()
            or full_method.startswith(("/grpc.health", "/grpc.reflection"))
            or full_method == SHARED_STREAM_METHOD
        ):
            return handler
        metadata = tuple(handler_call_details.invocation_metadata or ())
        name = full_method.lstrip("/")
        attributes = {"rpc.system": "grpc", "rpc.method": name, "llmmesh.service": self._service}

        def open_span() -> Span:
            return tracer().start_span(
                name, context=extract_context(metadata), kind=SpanKind.SERVER, attributes=attributes
            )

        async def run_unary(behavior: Any, request: Any, context: Any) -> Any:
            span = open_span()
            try:
                with trace.use_span(
                    span, end_on_exit=False, record_exception=False, set_status_on_exception=False
                ):
                    return await behavior(request, context)
            except BaseException as exc:
                mark_failed(span, exc)
                raise
            finally:
                span.end()

        async def run_stream(behavior: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            span = open_span()
            try:
                with trace.use_span(
                    span, end_on_exit=False, record_exception=False, set_status_on_exception=False
                ):
                    result = behavior(request, context)
                    if inspect.isasyncgen(result):
                        async for item in result:
                            record_stage_spans(span, item, time.time_ns())
                            yield item
                    else:
                        await result
            except BaseException as exc:
                mark_failed(span, exc)
                raise
            finally:
                span.end()

        return wrap_handler(handler, run_unary, run_stream)
