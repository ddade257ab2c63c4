"""The router's bidirectional ``Chat``: turns in order, a cancel that races a turn's end, an
unreadable message, and bounds on what waits in either direction (a stand-in pipeline)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.common import errors
from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.admission.auth import Authenticator, Principal
from services.router.api.servicer import CHAT_OUT_MESSAGES, MAX_WAITING_TURNS, RouterServicer

pytestmark = pytest.mark.timeout(30)


class FakeContext:
    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> float | None:
        return None


class FakePipeline:
    """Answers each turn with ``tokens`` deltas and an end; then, as the real pipeline does
    while its replay buffer is closed, takes ``after_end_s`` more before it returns."""

    def __init__(self, tokens: int = 2, after_end_s: float = 0.0) -> None:
        self.tokens = tokens
        self.after_end_s = after_end_s
        self.pulled = 0  # messages the handler took from the pipeline
        self.ended = asyncio.Event()

    async def run_turn(
        self, principal: Principal, request: router_pb2.ChatRequest, deadline: float | None, **_: Any
    ) -> AsyncIterator[router_pb2.ChatResponse]:
        for i in range(self.tokens):
            self.pulled += 1
            yield router_pb2.ChatResponse(
                request_id=request.request_id, seq=i + 1, delta=router_pb2.TokenDelta(text=f" t{i}")
            )
        self.pulled += 1
        end = router_pb2.TurnEnd(finish_reason=common_pb2.FINISH_REASON_LENGTH)
        yield router_pb2.ChatResponse(request_id=request.request_id, seq=self.tokens + 1, end=end)
        self.ended.set()
        await asyncio.sleep(self.after_end_s)


def servicer(pipeline: FakePipeline) -> RouterServicer:
    return RouterServicer(pipeline, Authenticator.open(), None, "round_robin")  # type: ignore[arg-type]


def turn(text: str) -> router_pb2.ChatRequest:
    return router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content=text)])


async def test_a_cancel_that_races_a_turns_end_leaves_the_stream_open_for_the_next() -> None:
    """Cancelled after its TurnEnd went out (while it closed its replay writer), the turn is
    over: the handler raised the task's CancelledError and the stream hung without a status."""
    pipeline = FakePipeline(after_end_s=0.5)
    next_turn = asyncio.Event()

    async def client() -> AsyncIterator[router_pb2.ChatRequest]:
        yield turn("first")
        await pipeline.ended.wait()
        yield router_pb2.ChatRequest(cancel=True)
        await next_turn.wait()
        yield turn("second")

    got: list[router_pb2.ChatResponse] = []
    async for response in servicer(pipeline).Chat(client(), FakeContext()):  # type: ignore[arg-type]
        got.append(response)
        if response.HasField("end"):
            next_turn.set()
    ends = [r.end.finish_reason for r in got if r.HasField("end")]
    assert ends == [common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_LENGTH]


async def test_an_unreadable_message_ends_the_stream_invalid_argument() -> None:
    class Unreadable:
        def __aiter__(self) -> Unreadable:
            self.sent = False
            return self

        async def __anext__(self) -> router_pb2.ChatRequest:
            from google.protobuf.message import DecodeError

            if not self.sent:
                self.sent = True
                return turn("first")
            raise DecodeError("Error parsing message")  # what grpc raises for bytes that are no ChatRequest

    got: list[router_pb2.ChatResponse] = []
    with pytest.raises(errors.InvalidArgument, match=r"^request: not a ChatRequest"):
        async for response in servicer(FakePipeline()).Chat(Unreadable(), FakeContext()):  # type: ignore[arg-type]
            got.append(response)
    assert got[-1].HasField("end")  # the turn before it was answered whole


async def test_turns_queued_past_the_bound_are_refused() -> None:
    pipeline = FakePipeline(tokens=1, after_end_s=0.05)

    async def client() -> AsyncIterator[router_pb2.ChatRequest]:
        for i in range(MAX_WAITING_TURNS + 4):
            yield turn(f"turn {i}")
        await asyncio.sleep(10)  # the client keeps its stream open

    ends = 0
    with pytest.raises(errors.Overloaded, match=f"at most {MAX_WAITING_TURNS} turns may wait"):
        async for response in servicer(pipeline).Chat(client(), FakeContext()):  # type: ignore[arg-type]
            ends += response.HasField("end")
    # Those that waited (and the one running, if it had started) were answered; none after.
    assert MAX_WAITING_TURNS <= ends <= MAX_WAITING_TURNS + 1


async def test_an_answer_is_pulled_only_as_fast_as_the_client_reads_it() -> None:
    pipeline = FakePipeline(tokens=1000)

    async def client() -> AsyncIterator[router_pb2.ChatRequest]:
        yield turn("a long one")
        await asyncio.sleep(10)

    stream = servicer(pipeline).Chat(client(), FakeContext())  # type: ignore[arg-type]
    first = await stream.__anext__()
    assert first.HasField("delta")
    await asyncio.sleep(0.3)  # the client reads nothing more meanwhile
    # What is queued ahead of the client, the message being put, and the one it read.
    assert pipeline.pulled <= CHAT_OUT_MESSAGES + 2
    await stream.aclose()


async def test_a_cancel_while_the_turn_waits_for_a_slow_reader_loses_no_message() -> None:
    """The client stopped reading, the turn waits with its messages queued, and a cancel comes:
    every message made reaches the client, numbered without a gap, and then exactly one end
    (a message the turn was putting when cancelled was lost: its end, and the turn had none)."""
    pipeline = FakePipeline(tokens=CHAT_OUT_MESSAGES + 1)
    cancel = asyncio.Event()

    async def client() -> AsyncIterator[router_pb2.ChatRequest]:
        yield turn("first")
        await cancel.wait()
        yield router_pb2.ChatRequest(cancel=True)

    stream = servicer(pipeline).Chat(client(), FakeContext())  # type: ignore[arg-type]
    got = [await stream.__anext__()]  # then the client reads nothing for a while
    await asyncio.sleep(0.2)
    cancel.set()
    await asyncio.sleep(0.05)
    async for response in stream:
        got.append(response)
    assert sum(r.HasField("end") for r in got) == 1 and got[-1].HasField("end")
    assert [r.seq for r in got] == list(range(1, len(got) + 1))
