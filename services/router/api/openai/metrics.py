"""Prometheus metrics of the HTTP front, by route (a fixed set, never the raw path) and status."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Counter, Histogram

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
ROUTES = ("/health", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/embeddings")


def route_label(path: str) -> str:
    """The route a path falls under: a client cannot grow the label set by inventing paths."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


class HttpMetrics:
    """ASGI middleware counting every response by route and status, and timing it to its last byte."""

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

        try:
            await self.app(scope, receive, send_counted)
        finally:
            route = route_label(scope.get("path", ""))
            HTTP_REQUESTS.labels(route, str(status[0] or 499)).inc()
            HTTP_SECONDS.labels(route).observe(time.perf_counter() - started)
