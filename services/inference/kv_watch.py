"""One ``WatchKvEvents`` watcher on the asyncio side: a snapshot, then the deltas as they come.

The engine thread never waits for a watcher: it only schedules a wake-up on the watcher's loop
(``call_soon_threadsafe``). The watcher reads the event log's ring at its own pace; while the
transport is slow to take a message this generator is simply not resumed, and if the ring moved
on meanwhile the next message is a fresh snapshot (``KvEventLog.since`` says so).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.inference.kv_events import KvDelta, KvEventLog, KvSnapshot

#: How often a waiting watcher looks at the drain flag (the replica's grace period is seconds).
STOP_POLL_S = 0.5


async def watch_kv_events(
    log: KvEventLog, stopping: asyncio.Event
) -> AsyncIterator[tuple[KvSnapshot | None, list[KvDelta]]]:
    """(snapshot, []) first and after falling behind, else (None, the deltas since the last
    message); ends once ``stopping`` is set (the replica drains)."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def on_delta() -> None:  # the engine thread
        with contextlib.suppress(RuntimeError):  # the loop closed under a late delta
            loop.call_soon_threadsafe(wake.set)

    unsubscribe = log.subscribe(on_delta)
    try:
        snapshot = log.snapshot()
        at = snapshot.sequence
        yield snapshot, []
        while not stopping.is_set():
            deltas = log.since(at)
            if deltas is None:
                snapshot = log.snapshot()
                at = snapshot.sequence
                yield snapshot, []
            elif deltas:
                at = deltas[-1].sequence
                yield None, deltas
            else:
                wake.clear()
                if log.sequence != at:
                    continue  # published between since() and clear(): its wake-up may be spent
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), STOP_POLL_S)
    finally:
        unsubscribe()
