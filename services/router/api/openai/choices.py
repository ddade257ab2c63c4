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


class _Quiet:
    """Marks on the queue that the reader has waited its whole timeout (``next``)."""


_QUIET = _Quiet()
ChoiceEvent = tuple[int, router_pb2.ChatResponse]


@dataclass
class ChoiceAnswer:
    """One choice as a whole answer."""

    parts: list[str] = field(default_factory=list)
    end: router_pb2.TurnEnd | None = None
    #: One per answer token when the request asked for logprobs.
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    #: One per prompt token when the request asked for prompt logprobs (completions' echo).
    prompt_logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    #: The prompt's ids decoded as one text, with ``prompt_logprobs`` (``TokenDelta.prompt_text``).
    prompt_text: str = ""

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
        self._queue: asyncio.Queue[tuple[int, router_pb2.ChatResponse | _Done | _Quiet | BaseException]] = (
            asyncio.Queue()
        )
        self._running = len(sources)
        # Set by ``detach``: nobody reads any more, the turns run on for a later resume.
        self._detached = False
        #: The choice of the last message or error ``next`` handed out.
        self.last_index = 0
        # ``next``'s timeout: one timer for the stream, re-armed only when it fires early (see
        # ``_quiet_check``), instead of a timer set and cancelled around every message.
        self._quiet_due = 0.0
        self._quiet_timer: asyncio.TimerHandle | None = None
        self._waiting = False
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
        admitted: bool = False,
    ) -> ChoiceStreams:
        """``admitted``: the caller took the key's requests for every turn at once (``admit_choices``)."""
        return cls([pipeline.run_turn(principal, turn, deadline, admitted=admitted) for turn in turns])

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
            if timeout is not None and self._queue.empty():
                self._arm_quiet(timeout)
            self._waiting = True
            try:
                index, item = await self._queue.get()
            finally:
                self._waiting = False
            if isinstance(item, _Quiet):
                raise TimeoutError(f"no message in {timeout} s")
            if isinstance(item, _Done):
                self._running -= 1
                continue
            self.last_index = index
            if isinstance(item, BaseException):
                raise item
            return index, item
        return None

    def _arm_quiet(self, timeout: float) -> None:
        """The wait starting now ends in ``_QUIET`` after ``timeout`` s without a message.

        Setting and cancelling a timer around every wait (``wait_for``, or a timeout scope) cost
        more per relayed token than the chunk's own framing (bench/serving_front.py measures the
        front's CPU per token). Here a wait only moves the due time; the one timer, when it
        fires, either finds the current wait overdue or sets itself for its due time.
        """
        loop = asyncio.get_running_loop()
        self._quiet_due = loop.time() + timeout
        if self._quiet_timer is None:
            self._quiet_timer = loop.call_at(self._quiet_due, self._quiet_check)

    def _quiet_check(self) -> None:
        self._quiet_timer = None
        if not self._waiting:
            return  # the reader is busy, not waiting: its next wait arms the timer again
        loop = asyncio.get_running_loop()
        if loop.time() >= self._quiet_due:
            self._queue.put_nowait((self.last_index, _QUIET))
        else:
            self._quiet_timer = loop.call_at(self._quiet_due, self._quiet_check)

    async def answers(self) -> list[ChoiceAnswer]:
        """Every choice, whole."""
        answers = [ChoiceAnswer() for _ in self._tasks]
        while (event := await self.next()) is not None:
            index, response = event
            if response.HasField("delta"):
                answers[index].parts.append(response.delta.text)
                answers[index].logprobs.extend(response.delta.logprobs)
                answers[index].prompt_logprobs.extend(response.delta.prompt_logprobs)
                answers[index].prompt_text += response.delta.prompt_text
            else:
                check_end(response.end)
                answers[index].end = response.end
        return answers

    def detach(self) -> asyncio.Future[Any]:
        """The reader has gone but the turns run on (their messages still reach the replay buffer):
        what finishes when they have all ended. ``close`` still cancels them."""
        self._detached = True
        self._stop_quiet_timer()
        while not self._queue.empty():  # nobody will read what is queued: let it go
            self._queue.get_nowait()
        return asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Cancel whatever still runs, and wait until it has let go of its replicas."""
        self._stop_quiet_timer()
        for task in self._tasks:
            task.cancel()
        # return_exceptions: the turns' own CancelledErrors are results here; a cancel of the
        # caller itself still propagates.
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _stop_quiet_timer(self) -> None:
        if self._quiet_timer is not None:
            self._quiet_timer.cancel()
            self._quiet_timer = None
