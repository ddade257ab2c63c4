"""The turns of one HTTP request (one per choice) run at once through the router's turn pipeline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common import errors
from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.admission.auth import Principal
from services.router.streams.replay import ReplayBuffer
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
    #: One per answer token when the request asked for logprobs.
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)

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

    Each source runs in its own task feeding one queue, so a slow choice never holds
    back a fast one, and ``close`` cancels them all (the replicas free their rows).
    A source is a live turn (``of_turns``) or its messages read back from the replay
    buffer (``of_replay``, for a client resuming with ``Last-Event-ID``).
    """

    def __init__(self, sources: Sequence[AsyncIterator[router_pb2.ChatResponse]]) -> None:
        self._queue: asyncio.Queue[tuple[int, router_pb2.ChatResponse | _Done | BaseException]] = (
            asyncio.Queue()
        )
        self._running = len(sources)
        # Set by ``detach``: nobody reads any more, the turns run on for a later resume.
        self._detached = False
        #: The choice of the last message or error ``next`` handed out.
        self.last_index = 0
        self._tasks = [asyncio.create_task(self._run(i, source)) for i, source in enumerate(sources)]

    @property
    def count(self) -> int:
        """How many choices."""
        return len(self._tasks)

    @classmethod
    def of_turns(
        cls,
        pipeline: TurnPipeline,
        principal: Principal,
        turns: Sequence[router_pb2.ChatRequest],
        deadline: float | None,
    ) -> ChoiceStreams:
        return cls([pipeline.run_turn(principal, turn, deadline) for turn in turns])

    @classmethod
    def of_replay(cls, replay: ReplayBuffer, tenant: str, request_ids: Sequence[str]) -> ChoiceStreams:
        """Each turn's messages from the start, as the replay buffer kept them (and live until they end)."""

        async def read(request_id: str) -> AsyncIterator[router_pb2.ChatResponse]:
            async for payload in replay.read_after(request_id, tenant, 0):
                yield router_pb2.ChatResponse.FromString(payload)

        return cls([read(r) for r in request_ids])

    async def _run(self, index: int, source: AsyncIterator[router_pb2.ChatResponse]) -> None:
        try:
            async for response in source:
                if not self._detached:
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
            self.last_index = index
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
                answers[index].logprobs.extend(response.delta.logprobs)
            else:
                check_end(response.end)
                answers[index].end = response.end
        return answers

    def detach(self) -> asyncio.Future[Any]:
        """The reader has gone but the turns run on (their messages still reach the replay buffer):
        what finishes when they have all ended. ``close`` still cancels them."""
        self._detached = True
        while not self._queue.empty():  # nobody will read what is queued: let it go
            self._queue.get_nowait()
        return asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Cancel whatever still runs, and wait until it has let go of its replicas."""
        for task in self._tasks:
            task.cancel()
        # return_exceptions: the turns' own CancelledErrors are results here; a cancel of the
        # caller itself still propagates.
        await asyncio.gather(*self._tasks, return_exceptions=True)
