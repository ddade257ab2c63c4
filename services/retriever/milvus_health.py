"""The retriever's health after start-up: NOT_SERVING while Milvus cannot be reached.

Start-up turns SERVING once Milvus answered (runtime.py); from then on this watcher asks
Milvus on a period (``--milvus-check-seconds``) and flips health to NOT_SERVING while it
cannot be reached and back to SERVING when it answers again, so readiness takes a retriever
whose Milvus is gone out of the Service instead of sending it searches that all fail
UNAVAILABLE (docs/operations.md, "Draining"). pymilvus reconnects by itself: the first check
that succeeds after an outage means calls succeed again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from services.common.errors import DependencyUnavailable
from services.common.server import HealthReporter

log = logging.getLogger("llmmesh.retriever")


class MilvusHealthWatcher:
    """Checks Milvus every ``interval_s`` and reports what it found to ``health``.

    ``check`` is blocking (``MilvusCollections.ping``) and runs on a thread of its own, so
    searches filling the shared executor never make a check late (and a slow check counts as
    Milvus unreachable, never as a busy retriever). Anything a check raises counts as
    unreachable and is logged; the watcher itself never stops until ``stop``. One log line per
    change of state, however long an outage lasts. Once the server is draining
    (``HealthReporter.stop_serving``) its ``set_serving`` changes nothing, so a check that
    succeeds then cannot report SERVING again.
    """

    def __init__(
        self,
        check: Callable[[], None],
        health: HealthReporter,
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self._check = check
        self._health = health
        self._interval_s = interval_s
        # pymilvus bounds each call by the Milvus timeout (a reconnect first may take another);
        # this bound only catches a check that would hang anyway.
        self._bound_s = 2 * timeout_s + 1.0
        #: The last state reported: Milvus had answered when start-up reported SERVING.
        self.reachable = True
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="milvus-health")
        self._in_flight: Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="milvus-health")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.check_once()

    async def check_once(self) -> None:
        """One check; reports a change of state (and logs it once)."""
        reachable = await self._probe()
        if reachable == self.reachable:
            return
        self.reachable = reachable
        if reachable:
            log.info("Milvus answers again, reporting SERVING")
        try:
            await self._health.set_serving(reachable)
        except Exception:  # the next change tries again; the watcher must live on
            log.exception("could not report health %s", "SERVING" if reachable else "NOT_SERVING")

    async def _probe(self) -> bool:
        """Whether Milvus answered; a failure is logged only when it changes the state."""
        try:
            self._in_flight = self._executor.submit(self._check)
            await asyncio.wait_for(asyncio.wrap_future(self._in_flight), self._bound_s)
            return True
        except DependencyUnavailable as exc:
            if self.reachable:
                log.warning("%s; reporting NOT_SERVING until it answers", exc)
        except TimeoutError:
            if self.reachable:
                log.warning(
                    "Milvus did not answer a health check within %.0fs; reporting NOT_SERVING", self._bound_s
                )
        except Exception:
            if self.reachable:
                log.exception("Milvus health check failed; reporting NOT_SERVING until one succeeds")
        return False

    async def stop(self, wait_s: float = 0.0) -> None:
        """Stops checking (never raises); with ``wait_s``, waits that long for a check still
        running on its thread, so the client is not closed under it."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        in_flight = self._in_flight
        if wait_s > 0 and in_flight is not None and not in_flight.done():
            with contextlib.suppress(Exception):
                await asyncio.wait({asyncio.wrap_future(in_flight)}, timeout=wait_s)
        self._executor.shutdown(wait=False, cancel_futures=True)
