"""Which of gRPC core's I/O implementations the router runs on: chosen before grpc is imported.

The router's work is relaying messages, and in grpc-python aio most of a
message's cost is thread hand-offs between gRPC's I/O threads and the asyncio
loop. gRPC core's I/O from before EventEngine (epoll driven by the
completion-queue thread itself) hands each message over fewer times than
EventEngine's own pollers: measured on the router, one-token answers arrive
0.05–0.09 ms sooner in every run, at about the same CPU per relayed token
(``bench/router.py``, docs/router.md). So the router turns EventEngine off for
its sockets unless told otherwise:

    LLMMESH_ROUTER_GRPC_IO=poller       # default: gRPC core's epoll poller
    LLMMESH_ROUTER_GRPC_IO=eventengine  # gRPC's default I/O

An operator's own ``GRPC_EXPERIMENTS`` is never overridden. gRPC reads the
setting once, so this must run before the first ``import grpc`` in the process.
"""

from __future__ import annotations

from collections.abc import MutableMapping

ENV = "LLMMESH_ROUTER_GRPC_IO"
CHOICES = ("poller", "eventengine")
#: gRPC experiments that, turned off, put every socket back on gRPC core's epoll poller.
POLLER_EXPERIMENTS = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"


def configure(environ: MutableMapping[str, str]) -> str:
    """Set ``GRPC_EXPERIMENTS`` in ``environ`` for the chosen I/O; returns the choice."""
    choice = environ.get(ENV, "poller").strip().lower() or "poller"
    if choice not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "poller":
        environ.setdefault("GRPC_EXPERIMENTS", POLLER_EXPERIMENTS)
    return choice
