"""Plugs the session service into the shared bootstrap and keeps health in step with Redis."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import grpc

from services.common.errors import DependencyUnavailable
from services.common.server import HealthReporter
from services.session.limits import SessionLimits
from services.session.servicer import SERVICE_NAME, SessionServicer, add_to_server
from services.session.store import SessionStore

log = logging.getLogger("llmmesh.session")


class RedisHealthWatcher:
    """Pings Redis on a period and reports NOT_SERVING while it cannot be reached.

    Reconnecting needs nothing here: the client's pool opens fresh connections on the next
    call, so the first successful ping after Redis returns flips health back to SERVING.
    """

    def __init__(self, store: SessionStore, health: HealthReporter, interval_s: float) -> None:
        self._store = store
        self._health = health
        self._interval_s = interval_s
        self._reachable: bool | None = None

    async def run(self) -> None:
        while True:
            try:
                await self._store.ping()
                reachable = True
            except DependencyUnavailable as exc:
                reachable = False
                if self._reachable is not False:
                    log.warning("redis unreachable, reporting NOT_SERVING: %s", exc)
            if reachable != self._reachable:
                if reachable and self._reachable is False:
                    log.info("redis reachable again, reporting SERVING")
                self._reachable = reachable
                await self._health.set_serving(reachable)
            await asyncio.sleep(self._interval_s)


class SessionRuntime:
    """The session service as the bootstrap sees it."""

    service_names: Sequence[str] = (SERVICE_NAME,)

    def __init__(self, store: SessionStore, limits: SessionLimits, ping_interval_s: float) -> None:
        self._store = store
        self._servicer = SessionServicer(store, limits)
        self._ping_interval_s = ping_interval_s
        self._watcher: asyncio.Task[None] | None = None

    def register(self, server: grpc.aio.Server) -> None:
        add_to_server(self._servicer, server)

    async def start(self, health: HealthReporter) -> None:
        # SERVING comes from the watcher's first successful ping, not from startup itself.
        watcher = RedisHealthWatcher(self._store, health, self._ping_interval_s)
        self._watcher = asyncio.create_task(watcher.run(), name="redis-health")

    async def drain(self) -> None:
        # Stop first: the watcher must not flip health back to SERVING while we shut down.
        await self._stop_watcher()

    async def close(self) -> None:
        await self._stop_watcher()
        await self._store.close()

    async def _stop_watcher(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
