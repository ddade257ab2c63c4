"""run_eagerly: a coroutine started on the caller's stack, finished from its futures' callbacks."""

from __future__ import annotations

import asyncio

from services.common.eager import run_eagerly


async def test_runs_up_to_its_first_wait_before_returning_then_finishes_when_the_future_does() -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[str] = loop.create_future()
    steps: list[str] = []
    ended: list[BaseException | None] = []

    async def work() -> None:
        steps.append("started")
        steps.append(await gate)
        await asyncio.sleep(0)  # a bare yield on the way
        steps.append("finished")

    run_eagerly(work(), ended.append)
    assert steps == ["started"]  # no loop turn happened: it ran on this stack
    gate.set_result("gate opened")
    for _ in range(5):
        await asyncio.sleep(0)
    assert steps == ["started", "gate opened", "finished"]
    assert ended == [None]


async def test_a_failure_reaches_on_done_whether_raised_at_once_or_from_a_future() -> None:
    loop = asyncio.get_running_loop()
    ended: list[BaseException | None] = []

    async def fails_at_once() -> None:
        raise ValueError("bad at once")

    run_eagerly(fails_at_once(), ended.append)
    assert len(ended) == 1 and isinstance(ended[0], ValueError)

    gate: asyncio.Future[None] = loop.create_future()

    async def fails_later() -> None:
        await gate

    run_eagerly(fails_later(), ended.append)
    gate.set_exception(ConnectionError("the call broke"))
    await asyncio.sleep(0)
    assert len(ended) == 2 and isinstance(ended[1], ConnectionError)


async def test_a_yield_that_is_not_a_future_is_refused_as_a_task_would_refuse_it() -> None:
    ended: list[BaseException | None] = []

    class Odd:
        def __await__(self):  # type: ignore[no-untyped-def]
            yield "not a future"

    async def odd() -> None:
        await Odd()

    run_eagerly(odd(), ended.append)
    assert len(ended) == 1 and isinstance(ended[0], RuntimeError)
    assert "not a future" in str(ended[0])
