"""The task loop through a Redis outage: said once, retried ever less often, its end said."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import redis.exceptions

from services.router.tasks import worker as worker_module
from services.router.tasks.settings import TaskSettings
from services.router.tasks.worker import OUTAGE_RETRY_MAX_S, TaskWorker

real_sleep = asyncio.sleep


class RedisAwayFor:
    """A task store whose Redis refuses the first ``passes`` calls, then has nothing queued."""

    def __init__(self, passes: int) -> None:
        self.left = passes
        self.answered = asyncio.Event()

    async def ensure_group(self) -> None:
        return None

    async def reclaim(self, consumer: str, min_idle_ms: int, count: int) -> list[tuple[str, str]]:
        if self.left > 0:
            self.left -= 1
            raise redis.exceptions.ConnectionError(
                "Error 111 connecting to 10.0.0.5:6379. Connection refused."
            )
        return []

    async def take_new(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, str]]:
        self.answered.set()
        await real_sleep(0.01)
        return []

    async def heartbeat(self, consumer: str, running: Any) -> list[str]:
        return []


async def test_an_outage_is_said_once_backed_off_and_its_end_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A WARNING a second per router for the whole outage flooded the logs (11 lines in 10 s)."""
    slept: list[float] = []

    async def recorded(delay: float) -> None:
        slept.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(worker_module.asyncio, "sleep", recorded)
    # The reclaim runs every pass while Redis is away (its next time is set only after it answered).
    store = RedisAwayFor(passes=8)
    worker = TaskWorker(store, None, "router-a", TaskSettings())  # type: ignore[arg-type]
    caplog.set_level(logging.DEBUG, logger="llmmesh.router.tasks")
    await worker.start()
    try:
        await asyncio.wait_for(store.answered.wait(), 5)
        await real_sleep(0.05)
    finally:
        await worker.stop(grace_s=0.1)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "llmmesh.router.tasks"]
    warnings = [m for level, m in said if level == logging.WARNING]
    assert len(warnings) == 1 and "ConnectionError" in warnings[0]
    assert sum(level == logging.DEBUG for level, _ in said) == 7
    assert [m for level, m in said if level == logging.INFO] == [
        "task worker: Redis answers again after 8 failed tries"
    ]
    # Ever less often, up to the cap: 0.5, 1, 2, 4, then every 5 s.
    assert slept[:8] == [0.5, 1.0, 2.0, 4.0] + [OUTAGE_RETRY_MAX_S] * 4
