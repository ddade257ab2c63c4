"""The replica's one grammar-compiler thread has a bounded queue (no model): past
``MAX_QUEUED_COMPILES`` distinct new constraints, another new one is refused at once with
RESOURCE_EXHAUSTED and a retry-after, instead of waiting behind minutes of compiles; a
constraint already queued and a cached one are not refused, and requests that leave before their
compile started take it off the queue."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.common import errors
from services.inference.async_engine import MAX_QUEUED_COMPILES, AsyncEngine
from services.inference.sampling import Constraint, ConstraintKind, SamplingParams
from tests.unit.inference.test_async_engine import FakeTokenEngine


class SlowCompiles(FakeTokenEngine):
    """Every new grammar compiles until ``release`` is set (a hostile schema takes seconds to
    minutes); a constraint named in ``cached`` is a copy, made off the compiler thread."""

    def __init__(self) -> None:
        super().__init__(tokens=1)
        self.release = threading.Event()
        self.started: list[str] = []
        self.cached: set[str] = set()

    def grammar_compiled(self, params: SamplingParams) -> bool:
        return params.constraint is None or params.constraint.spec in self.cached

    def make_guide(self, params: SamplingParams, resume: object) -> object:
        assert params.constraint is not None
        if params.constraint.spec not in self.cached:
            self.started.append(params.constraint.spec)
            self.release.wait(10.0)
        return object()


def regex(spec: str) -> SamplingParams:
    return SamplingParams(max_tokens=1, constraint=Constraint(ConstraintKind.REGEX, spec))


async def drain(engine: AsyncEngine, request_id: str, params: SamplingParams) -> None:
    async for _ in engine.generate(request_id, [1, 2, 3], params):
        pass


async def test_new_constraints_past_the_compile_queue_bound_are_refused_at_once() -> None:
    fake = SlowCompiles()
    fake.cached.add("cached")
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    waiting = [
        asyncio.create_task(drain(engine, f"new-{i}", regex(f"a{i}"))) for i in range(MAX_QUEUED_COMPILES)
    ]
    others: list[asyncio.Task[None]] = []
    try:
        await asyncio.sleep(0.2)
        assert fake.started == ["a0"]  # one compiling, the rest queued behind it
        # One more new constraint: refused at once, as a full waiting queue is.
        with pytest.raises(errors.Overloaded) as caught:
            await asyncio.wait_for(drain(engine, "one-more", regex("b")), 2.0)
        assert caught.value.code.name == "RESOURCE_EXHAUSTED"
        assert caught.value.retry_after_s > 0
        assert "compile" in str(caught.value)
        # A constraint already queued adds no compile: it waits for that one, not refused.
        others.append(asyncio.create_task(drain(engine, "same-as-queued", regex("a5"))))
        # A cached constraint needs no compile at all: served beside the full queue.
        await asyncio.wait_for(drain(engine, "cached", regex("cached")), 5.0)
        await asyncio.sleep(0.2)
        assert not others[0].done()
        # Requests that leave before their compile started take it off the queue: room again.
        for task in [*waiting[1:], *others]:
            task.cancel()
        await asyncio.gather(*waiting[1:], *others, return_exceptions=True)
        await asyncio.sleep(0.1)
        others.append(asyncio.create_task(drain(engine, "after-cancels", regex("c"))))
        await asyncio.sleep(0.2)
        assert not others[-1].done()  # queued behind the running compile, not refused
    finally:
        fake.release.set()
        for task in [*waiting, *others]:
            task.cancel()
        await asyncio.gather(*waiting, *others, return_exceptions=True)
        engine.close()
    assert fake.started[0] == "a0" and "a5" not in fake.started[1:]
