"""OpenTelemetry tracing for every service: setup, W3C traceparent over gRPC metadata, stage spans.

One trace per client request: the server interceptor (``tracing_server.py``)
continues the caller's trace from the ``traceparent`` metadata, and the client
interceptors here (installed on every ``grpc.aio`` channel made after
:func:`setup`) pass the current span on to the next service. Where spans go is
``tracing_export.py``'s choice. Where the time of a generation went (queue wait,
prefill, decode) is already reported in the ``Timings`` of the final stream
message, so those spans are rebuilt from it instead of threading a tracer
through the engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.common.tracing_export import exporter_from_env

log = logging.getLogger("llmmesh.tracing")

# W3C trace context only: it is what every OpenTelemetry SDK and mesh proxy speaks.
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER_NAME = "llmmesh"
#: The span of one generation, whether it ran on its own Generate call or on a shared stream.
GENERATION_SPAN = "llmmesh.v1.Inference/Generate"
#: The shared stream of many generations: no span of its own (see ``generation_span``).
SHARED_STREAM_METHOD = "/llmmesh.v1.Inference/GenerateMany"

# Client calls worth a named span of their own on the caller's side: the stages
# a slow request is usually blamed on.
CLIENT_STAGE_NAMES: dict[str, str] = {
    "/llmmesh.v1.Retriever/Search": "retrieval",
    "/llmmesh.v1.Retriever/CacheLookup": "semantic cache lookup",
    "/llmmesh.v1.Session/GetSession": "session history",
    "/llmmesh.v1.Session/AppendTurns": "session save",
}

_provider: TracerProvider | None = None
_channel_patch_lock = threading.Lock()
_channels_patched = False


def setup(service_name: str, exporter: SpanExporter | None = None) -> TracerProvider | None:
    """Install a tracer provider for this process and trace-propagating gRPC client channels.

    ``exporter`` overrides the environment's choice (tests pass an in-memory one).
    With no exporter at all tracing stays off: no span is made and no interceptor
    touches a call, so the token path pays nothing for traces nobody collects.
    """
    global _provider
    if exporter is not None:
        processor: SimpleSpanProcessor | BatchSpanProcessor = SimpleSpanProcessor(exporter)
    else:
        chosen = exporter_from_env()
        if chosen is None:
            return None
        env_exporter, batched = chosen
        processor = BatchSpanProcessor(env_exporter) if batched else SimpleSpanProcessor(env_exporter)
    provider = TracerProvider(resource=Resource.create({"service.name": f"llm-mesh-{service_name}"}))
    provider.add_span_processor(processor)
    _provider = provider
    install_channel_interceptors()
    return provider


def enabled() -> bool:
    """True once :func:`setup` found somewhere to send spans."""
    return _provider is not None


def shutdown() -> None:
    """Flush and stop the exporter (called once the server has stopped)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def tracer() -> trace.Tracer:
    """This process's tracer (a no-op one before :func:`setup`)."""
    if _provider is not None:
        return _provider.get_tracer(_TRACER_NAME)
    return trace.get_tracer(_TRACER_NAME)


@contextmanager
def stage(name: str, **attributes: str | int | float | bool) -> Iterator[Span]:
    """A child span of the current one for one stage of a request (e.g. ``cache lookup``)."""
    with tracer().start_as_current_span(name, attributes=attributes) as span:
        yield span


class _MetadataGetter(Getter[dict[str, str]]):
    def get(self, carrier: dict[str, str], key: str) -> list[str] | None:
        value = carrier.get(key)
        return [value] if value is not None else None

    def keys(self, carrier: dict[str, str]) -> list[str]:
        return list(carrier)


class _MetadataSetter(Setter[list[tuple[str, str]]]):
    def set(self, carrier: list[tuple[str, str]], key: str, value: str) -> None:
        carrier.append((key, value))


def extract_context(metadata: Sequence[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The caller's trace context from gRPC invocation metadata."""
    carrier = {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}
    return _PROPAGATOR.extract(carrier, getter=_MetadataGetter())


def inject_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> list[tuple[str, str | bytes]]:
    """``metadata`` plus the current span's ``traceparent`` (any stale one replaced)."""
    headers: list[tuple[str, str]] = []
    _PROPAGATOR.inject(headers, setter=_MetadataSetter())
    injected = {k for k, _ in headers}
    kept = [(k, v) for k, v in (metadata or ()) if k.lower() not in injected]
    return [*kept, *headers]


def current_traceparent() -> str:
    """The current span's W3C ``traceparent``, or "" when tracing is off or no span is current."""
    if _provider is None:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent", "")


@contextmanager
def detached() -> Iterator[None]:
    """Run with no current span: for work that outlives the request that started it (a shared stream)."""
    token = otel_context.attach(otel_context.Context())
    try:
        yield
    finally:
        otel_context.detach(token)


@contextmanager
def generation_span(traceparent: str, **attributes: str | int | float | bool) -> Iterator[Span | None]:
    """The SERVER span of one generation on a shared GenerateMany stream, under the caller's span.

    Named like a ``Generate`` call's span, since it is one generation either way.
    None when tracing is off.
    """
    if _provider is None:
        yield None
        return
    parent = extract_context([("traceparent", traceparent)]) if traceparent else otel_context.Context()
    span = tracer().start_span(
        GENERATION_SPAN, context=parent, kind=SpanKind.SERVER, attributes={"rpc.system": "grpc", **attributes}
    )
    try:
        with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            yield span
    except BaseException as exc:
        mark_failed(span, exc)
        raise
    finally:
        span.end()


def record_stage_spans(parent: Span, message: Any, end_ns: int) -> None:
    """Child spans for queue wait, prefill and decode from a final message's ``Timings``.

    Inference ends a stream with ``GenerationFinished`` and the router with
    ``TurnEnd``; both carry the timings the engine measured, so the spans are
    placed backwards from the moment that message was sent.
    """
    end = _final_event(message)
    if end is None or not end.HasField("timings"):
        return
    timings = end.timings
    stages = [
        ("queue wait", timings.queue_ms),
        ("prefill", timings.prefill_ms),
        ("decode", timings.decode_ms),
    ]
    if not any(ms > 0 for _, ms in stages):
        return
    ctx = trace.set_span_in_context(parent)
    cursor = end_ns - int(sum(max(ms, 0.0) for _, ms in stages) * 1e6)
    for name, ms in stages:
        duration = int(max(ms, 0.0) * 1e6)
        span = tracer().start_span(name, context=ctx, start_time=cursor, attributes={"duration_ms": ms})
        span.end(end_time=cursor + duration)
        cursor += duration
    if timings.ttft_ms > 0:
        parent.set_attribute("llmmesh.ttft_ms", timings.ttft_ms)


def _final_event(message: Any) -> Any | None:
    """The ``finished`` / ``end`` part of a stream message, when it is the last one."""
    which = getattr(message, "WhichOneof", None)
    if which is None:
        return None
    try:
        event = message.WhichOneof("event")
    except ValueError:
        return None
    if event in ("finished", "end"):
        return getattr(message, event)
    return None


def mark_failed(span: Span, exc: BaseException) -> None:
    """Mark ``span`` failed by ``exc``."""
    if isinstance(exc, grpc.aio.AbortError | GeneratorExit):
        # An abort already carries its status to the client; the span just says it failed.
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        return
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, str(exc) or type(exc).__name__))


def _with_traceparent(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    if not enabled():
        return details
    metadata = inject_metadata(list(details.metadata or ()))
    return grpc.aio.ClientCallDetails(
        details.method,
        details.timeout,
        grpc.aio.Metadata(*metadata),
        details.credentials,
        details.wait_for_ready,
    )


def _method_name(details: grpc.aio.ClientCallDetails) -> str:
    method = details.method
    return method.decode() if isinstance(method, bytes) else str(method)


class _UnaryUnaryTracing(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        method = _method_name(client_call_details)
        stage_name = CLIENT_STAGE_NAMES.get(method)
        if stage_name is None or not enabled():
            return await continuation(_with_traceparent(client_call_details), request)
        # A CLIENT span for the stages worth naming; the callee's SERVER span becomes its child.
        with tracer().start_as_current_span(
            stage_name, kind=SpanKind.CLIENT, attributes={"rpc.system": "grpc", "rpc.method": method}
        ):
            call = await continuation(_with_traceparent(client_call_details), request)
            await call  # the span should cover the whole call, not just its start
            return call


class _UnaryStreamTracing(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_traceparent(client_call_details), request)


class _StreamUnaryTracing(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(_with_traceparent(client_call_details), request_iterator)


class _StreamStreamTracing(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(_with_traceparent(client_call_details), request_iterator)


def client_interceptors() -> list[Any]:
    """Interceptors that carry the current trace to the callee, for all four call shapes."""
    return [_UnaryUnaryTracing(), _UnaryStreamTracing(), _StreamUnaryTracing(), _StreamStreamTracing()]


def install_channel_interceptors() -> None:
    """Make every later ``grpc.aio.insecure_channel`` / ``secure_channel`` propagate the trace.

    The same approach as OpenTelemetry's own gRPC instrumentation: services
    create channels in many places, and none of them should have to remember
    to pass interceptors for a trace to hold together.
    """
    global _channels_patched
    with _channel_patch_lock:
        if _channels_patched:
            return
        _channels_patched = True
        original_insecure = grpc.aio.insecure_channel
        original_secure = grpc.aio.secure_channel

        def insecure_channel(
            target: str,
            options: Any = None,
            compression: Any = None,
            interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
        ) -> grpc.aio.Channel:
            return original_insecure(
                target, options, compression, [*(interceptors or ()), *client_interceptors()]
            )

        def secure_channel(
            target: str,
            credentials: grpc.ChannelCredentials,
            options: Any = None,
            compression: Any = None,
            interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
        ) -> grpc.aio.Channel:
            return original_secure(
                target, credentials, options, compression, [*(interceptors or ()), *client_interceptors()]
            )

        grpc.aio.insecure_channel = insecure_channel  # type: ignore[assignment]
        grpc.aio.secure_channel = secure_channel  # type: ignore[assignment]
