"""The choices' messages reach the SSE writer in order, with a timeout only when nothing comes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from services.gen.llmmesh.v1 import router_pb2
from services.router.api.openai.choices import ChoiceStreams


def delta(text: str) -> router_pb2.ChatResponse:
    return router_pb2.ChatResponse(delta=router_pb2.TokenDelta(text=text))


async def paced(
    texts: list[str], gap_s: float, first_after_s: float = 0.0
) -> AsyncIterator[router_pb2.ChatResponse]:
    await asyncio.sleep(first_after_s)
    for i, text in enumerate(texts):
        if i:
            await asyncio.sleep(gap_s)
        yield delta(text)


async def test_messages_closer_than_the_timeout_never_time_out_however_long_the_stream() -> None:
    # 45 messages 30 ms apart: 1.3 s in all, each wait far under the 1 s timeout.
    streams = ChoiceStreams([paced([str(i) for i in range(45)], 0.03)])
    got = []
    while (event := await streams.next(timeout=1.0)) is not None:
        got.append(event[1].delta.text)
    assert got == [str(i) for i in range(45)]
    await streams.close()


async def test_a_quiet_wait_times_out_after_its_timeout_and_the_turn_goes_on() -> None:
    streams = ChoiceStreams([paced(["late", "later"], 0.01, first_after_s=0.7)])
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await streams.next(timeout=0.1)
    waited = time.monotonic() - started
    assert 0.09 <= waited < 0.5  # one timeout, not the time to the message
    with pytest.raises(TimeoutError):  # a second quiet period: a second keep-alive
        await streams.next(timeout=0.1)
    event = await streams.next(timeout=1.0)  # the turn was not cancelled by the timeouts
    assert event is not None and event[1].delta.text == "late"
    assert (await streams.next(timeout=1.0)) is not None
    assert await streams.next(timeout=1.0) is None
    await streams.close()


async def test_a_wait_abandoned_by_its_caller_leaves_no_timeout_for_the_next_reader() -> None:
    streams = ChoiceStreams([paced(["a", "b"], 0.25, first_after_s=0.25)])
    waiting = asyncio.ensure_future(streams.next(timeout=0.15))
    await asyncio.sleep(0.05)
    waiting.cancel()  # the client left, say
    await asyncio.gather(waiting, return_exceptions=True)
    await asyncio.sleep(0.15)  # past the abandoned wait's due time
    event = await streams.next(timeout=1.0)
    assert event is not None and event[1].delta.text == "a"
    await streams.close()
