"""Prometheus counters of the async tasks: finished, reclaimed, resumed, running, refused."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

TASKS_FINISHED = Counter("llmmesh_router_tasks_total", "Async tasks finished, by final state.", ["state"])
TASKS_RECLAIMED = Counter(
    "llmmesh_router_tasks_reclaimed_total", "Tasks taken over from a router that stopped acknowledging them."
)
TASKS_RESUMED = Counter(
    "llmmesh_router_tasks_resumed_total",
    "Task attempts that continued an answer another attempt had started, after its delivered tokens.",
)
TASKS_RUNNING = Gauge("llmmesh_router_tasks_running", "Async tasks this router is running now.")
TASKS_REFUSED = Counter(
    "llmmesh_router_tasks_refused_total",
    "Task submissions refused at admission, by reason (tenant_cap, tenant_bytes, queue_full).",
    ["reason"],
)
