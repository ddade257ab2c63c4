"""Prometheus metrics and trace spans of the HTTP front, by route (a fixed set, never the raw path) and status."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Histogram

from services.common import tracing
from services.common.metrics import LATENCY_BUCKETS

HTTP_REQUESTS = Counter(
    "llmmesh_router_http_requests_total",
    "HTTP requests to the OpenAI front, by route and status.",
    ["route", "status"],
)
HTTP_SECONDS = Histogram(
    "llmmesh_router_http_request_seconds",
    "From an HTTP request's arrival to the end of its response (the whole stream for SSE).",
    ["route"],
    buckets=LATENCY_BUCKETS,
)
ROUTES = (
    "/health",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",  # counted under `other`, with the 404s, until 2026-12-07
)


def route_label(path: str) -> str:
    """The route a path falls under: a client cannot grow the label set by inventing paths."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    return "other"


class HttpMetrics:
    """ASGI middleware counting every response by route and status, and timing it to its last byte.

    With tracing on, each request is also one SERVER span, as a gRPC call is one (the gRPC side's
    interceptor cannot see HTTP): it continues the caller's W3C ``traceparent`` header, and the
    turn's own spans and downstream calls (session, retriever, the replica's generation) are its
    children, since the turn runs in tasks made inside it.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [0]  # 0 = no response started: the client left first

        async def send_counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        route = route_label(scope.get("path", ""))
        span = _open_span(scope, route) if tracing.enabled() else None
        try:
            if span is None:
                await self.app(scope, receive, send_counted)
            else:
                with trace.use_span(
                    span, end_on_exit=False, record_exception=False, set_status_on_exception=False
                ):
                    await self.app(scope, receive, send_counted)
        finally:
            code = status[0] or 499
            HTTP_REQUESTS.labels(route, str(code)).inc()
            HTTP_SECONDS.labels(route).observe(time.perf_counter() - started)
            if span is not None:
                span.set_attribute("http.response.status_code", code)
                if code >= 500:
                    span.set_status(Status(StatusCode.ERROR, f"HTTP {code}"))
                span.end()


def _open_span(scope: dict[str, Any], route: str) -> Any:
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", [])]
    method = scope.get("method", "GET")
    return tracing.tracer().start_span(
        f"{method} {route}",
        context=tracing.extract_context([h for h in headers if h[0] in ("traceparent", "tracestate")]),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": method, "http.route": route, "llmmesh.service": "router"},
    )
