"""The Redis health watcher and its stop, without servers (the real service: test_session_health_watcher.py)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from redis.exceptions import NoPermissionError

from services.common.errors import DependencyUnavailable
from services.common.server import HealthReporter
from services.session.limits import SessionLimits
from services.session.runtime import RedisHealthWatcher, SessionRuntime
from services.session.store import SessionStore


class FakeStore:
    def __init__(self, *answers: BaseException | None) -> None:
        self.answers = list(answers)
        self.closed = False

    async def ping(self) -> None:
        answer = self.answers.pop(0) if self.answers else None
        if answer is not None:
            raise answer

    async def close(self) -> None:
        self.closed = True


class FakeHealth:
    def __init__(self) -> None:
        self.reported: list[bool] = []

    async def set_serving(self, serving: bool) -> None:
        self.reported.append(serving)


async def test_any_failed_ping_is_not_serving_and_the_next_good_one_serving_again() -> None:
    store = FakeStore(
        None, NoPermissionError("this user has no permissions to run the 'ping' command"), RuntimeError("?")
    )
    store.answers += [DependencyUnavailable("down"), None]
    health = FakeHealth()
    watcher = RedisHealthWatcher(cast(SessionStore, store), cast(HealthReporter, health), 0.001)
    for _ in range(5):
        await watcher.check()
    assert health.reported == [True, False, True]


async def test_the_watch_goes_on_past_any_error_and_stops_only_when_cancelled() -> None:
    class Failing(FakeHealth):
        async def set_serving(self, serving: bool) -> None:
            await super().set_serving(serving)
            if len(self.reported) == 1:
                raise RuntimeError("a bug in reporting")

    store, health = FakeStore(NoPermissionError("NOPERM")), Failing()
    watcher = RedisHealthWatcher(cast(SessionStore, store), cast(HealthReporter, health), 0.001)
    task = asyncio.create_task(watcher.run())
    for _ in range(5000):
        if len(health.reported) >= 2 or task.done():
            break
        await asyncio.sleep(0.001)
    assert not task.done(), task  # the ping's error, then the report's, did not end it
    assert health.reported == [False, True]  # PING answered after the report failed: said so
    task.cancel()
    await asyncio.wait({task})
    assert task.cancelled()


async def test_stopping_a_watcher_that_died_never_raises_so_the_server_still_stops() -> None:
    """drain() re-raised a dead watcher's exception: serve() then skipped server.stop(grace) and
    close(), cutting in-flight RPCs and dying with a traceback."""
    store = FakeStore()
    runtime = SessionRuntime(cast(SessionStore, store), SessionLimits(), 0.001)

    async def died() -> None:
        raise NoPermissionError("NOPERM")

    dead: Any = asyncio.create_task(died())
    await asyncio.wait({dead})
    runtime._watcher = dead
    await runtime.drain()
    await runtime.close()
    assert store.closed
