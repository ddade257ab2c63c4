"""Prometheus metrics of the session service: operations by result, Redis round-trip latency."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prometheus_client import Counter, Histogram

from services.common import errors

SESSION_OPS = Counter(
    "llmmesh_session_ops_total",
    "Session operations by kind (create, get, append, …) and result (ok, not_found, conflict, …).",
    ["op", "result"],
)
# Finer low end than the shared RPC buckets: a healthy Redis answers in well under a millisecond.
REDIS_LATENCY = Histogram(
    "llmmesh_session_redis_latency_seconds",
    "Time of one Redis round trip (script or command), by operation.",
    ["op"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)


# Result labels by domain error; anything else counts as "error".
_RESULTS: tuple[tuple[type[Exception], str], ...] = (
    (errors.InvalidArgument, "invalid"),
    (errors.NotFound, "not_found"),
    (errors.PermissionDenied, "denied"),
    (errors.AlreadyExists, "exists"),
    (errors.Conflict, "conflict"),
    (errors.LimitExceeded, "limit"),
    (errors.DependencyUnavailable, "unavailable"),
)


def result_of(exc: BaseException) -> str:
    for kind, label in _RESULTS:
        if isinstance(exc, kind):
            return label
    return "error"


@asynccontextmanager
async def observe_op(op: str) -> AsyncIterator[None]:
    """Counts one session operation under the result it ended with."""
    try:
        yield
    except Exception as exc:
        SESSION_OPS.labels(op, result_of(exc)).inc()
        raise
    SESSION_OPS.labels(op, "ok").inc()
