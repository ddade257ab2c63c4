"""Prometheus metrics shared by every service (names follow Prometheus rules, `llmmesh_` prefix)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

# Latency buckets from 1 ms to 2 min: covers cache hits and long generations.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)

REQUESTS = Counter(
    "llmmesh_requests_total",
    "RPCs handled, by service, method and final gRPC status code.",
    ["service", "method", "code"],
)
REQUEST_SECONDS = Histogram(
    "llmmesh_request_duration_seconds",
    "Time from RPC start to its final status, by service and method.",
    ["service", "method"],
    buckets=LATENCY_BUCKETS,
)
