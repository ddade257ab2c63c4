"""Plugs the session service into the shared bootstrap and keeps health in step with Redis."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
from redis.exceptions import RedisError

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

    Any failure of a check counts as unreachable, not only DependencyUnavailable: a Redis that
    answers PING with an error the store does not classify (NOPERM after an ACL change, an
    unexpected reply) cannot be relied on either. Until 2026-12-07 such an error ended the
    watcher task silently: health stayed SERVING for good, and the task's exception, re-raised
    when shutdown stopped it, skipped the server's graceful stop (in-flight RPCs cut).
    """

    def __init__(self, store: SessionStore, health: HealthReporter, interval_s: float) -> None:
        self._store = store
        self._health = health
        self._interval_s = interval_s
        self._reachable: bool | None = None

    async def run(self) -> None:
        """Checks until cancelled; nothing but cancellation ends it."""
        while True:
            try:
                await self.check()
            except Exception:  # a bug in reporting must not end the watch either
                log.exception("redis health check failed; checking again in %.1f s", self._interval_s)
            await asyncio.sleep(self._interval_s)

    async def check(self) -> None:
        """One ping, and health set when reachability changed."""
        try:
            await self._store.ping()
            reachable = True
        except Exception as exc:  # CancelledError is not an Exception: cancelling still stops it
            reachable = False
            if self._reachable is not False:
                log.warning(
                    "redis unreachable, reporting NOT_SERVING: %s: %s",
                    type(exc).__name__,
                    exc,
                    # Redis's own answer says it all; anything else is a bug: where it came from.
                    exc_info=not isinstance(exc, (DependencyUnavailable, RedisError)),
                )
        if reachable != self._reachable:
            if reachable and self._reachable is False:
                log.info("redis reachable again, reporting SERVING")
            await self._health.set_serving(reachable)
            self._reachable = reachable


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
        """Never raises: shutdown goes on to the server's graceful stop and close whatever the
        watcher did (a re-raised failure of its skipped both, cutting in-flight RPCs)."""
        watcher, self._watcher = self._watcher, None
        if watcher is None:
            return
        watcher.cancel()
        # wait() does not raise what the task raised (awaiting it did); only our own cancellation.
        await asyncio.wait({watcher})
        if not watcher.cancelled() and (failure := watcher.exception()) is not None:
            log.error("redis health watcher had failed", exc_info=failure)
