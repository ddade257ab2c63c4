"""The turns of one HTTP request (one per choice) run at once through the router's turn pipeline."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common import errors
from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.admission.auth import Principal
from services.router.turns.pipeline import TurnPipeline


class _Done:
    """Marks on the queue that one choice's turn has ended."""


_DONE = _Done()
ChoiceEvent = tuple[int, router_pb2.ChatResponse]


@dataclass
class ChoiceAnswer:
    """One choice as a whole answer."""

    parts: list[str] = field(default_factory=list)
    end: router_pb2.TurnEnd | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


def check_end(end: router_pb2.TurnEnd) -> None:
    """A turn that ended in-band with an error (tokens had flowed, then every replica failed) fails the request."""
    if end.finish_reason == common_pb2.FINISH_REASON_ERROR:
        raise errors.DependencyUnavailable(end.error_message or "the answer failed part-way")
    if end.finish_reason == common_pb2.FINISH_REASON_CANCELLED:
        raise errors.DependencyUnavailable("the answer was cancelled part-way")


class ChoiceStreams:
    """Runs every choice's turn at once and hands out their messages in the order they arrive.

    Each turn runs in its own task feeding one queue, so a slow choice never holds
    back a fast one, and ``close`` cancels them all (the replicas free their rows).
    """

    def __init__(
        self,
        pipeline: TurnPipeline,
        principal: Principal,
        turns: Sequence[router_pb2.ChatRequest],
        deadline: float | None,
    ) -> None:
        self._queue: asyncio.Queue[tuple[int, router_pb2.ChatResponse | _Done | BaseException]] = (
            asyncio.Queue()
        )
        self._running = len(turns)
        self._tasks = [
            asyncio.create_task(self._run(pipeline, principal, i, turn, deadline))
            for i, turn in enumerate(turns)
        ]

    async def _run(
        self,
        pipeline: TurnPipeline,
        principal: Principal,
        index: int,
        turn: router_pb2.ChatRequest,
        deadline: float | None,
    ) -> None:
        try:
            async for response in pipeline.run_turn(principal, turn, deadline):
                self._queue.put_nowait((index, response))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the reader, which answers with the error table
            self._queue.put_nowait((index, exc))
            return
        self._queue.put_nowait((index, _DONE))

    async def next(self, timeout: float | None = None) -> ChoiceEvent | None:
        """The next message of any choice; None once every turn has ended. ``TimeoutError`` after ``timeout``
        seconds without one (the turns go on: only the wait is abandoned)."""
        while self._running:
            index, item = await asyncio.wait_for(self._queue.get(), timeout)
            if isinstance(item, _Done):
                self._running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return index, item
        return None

    async def answers(self) -> list[ChoiceAnswer]:
        """Every choice, whole."""
        answers = [ChoiceAnswer() for _ in self._tasks]
        while (event := await self.next()) is not None:
            index, response = event
            if response.HasField("delta"):
                answers[index].parts.append(response.delta.text)
            else:
                check_end(response.end)
                answers[index].end = response.end
        return answers

    async def close(self) -> None:
        """Cancel whatever still runs, and wait until it has let go of its replicas."""
        for task in self._tasks:
            task.cancel()
        # return_exceptions: the turns' own CancelledErrors are results here; a cancel of the
        # caller itself still propagates.
        await asyncio.gather(*self._tasks, return_exceptions=True)
