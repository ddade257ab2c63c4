"""Server-sent events: chunks as tokens arrive, keep-alives while waiting, cancel when the client leaves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from services.gen.llmmesh.v1 import common_pb2
from services.router.api.openai.choices import ChoiceEvent, ChoiceStreams, check_end
from services.router.api.openai.errors import api_error
from services.router.api.openai.framing import DONE, KEEPALIVE, Framer, sse

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # Proxies that buffer (nginx) would hold tokens back: a stream is useful only as it happens.
    (b"x-accel-buffering", b"no"),
]


class NoEventYet:
    """The first message did not come before the response had to start (the turns are queued)."""


NO_EVENT_YET = NoEventYet()


async def until_disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def sse_body(
    streams: ChoiceStreams,
    framer: Framer,
    first: ChoiceEvent | NoEventYet,
    include_usage: bool,
    keepalive_s: float,
) -> AsyncIterator[bytes]:
    """The whole event stream of one request: every choice's chunks, usage if asked, then [DONE]."""
    seq = 0

    def event(payload: Any) -> bytes:
        nonlocal seq
        seq += 1
        return sse(f"{framer.completion_id}-{seq}", payload)

    opened: set[int] = set()
    usages: dict[int, common_pb2.Usage] = {}
    pending: ChoiceEvent | None = None
    if isinstance(first, NoEventYet):
        yield KEEPALIVE
    else:
        pending = first
    while True:
        if pending is not None:
            item: ChoiceEvent | None = pending
            pending = None
        else:
            try:
                item = await streams.next(keepalive_s)
            except TimeoutError:
                # Nothing for a while (queued, or a slow prefill): a comment keeps proxies and
                # clients from timing the connection out, and no client shows it.
                yield KEEPALIVE
                continue
            except Exception as exc:
                # The status line is long gone: the error goes in-band, as OpenAI's own streams send it.
                yield event(api_error(exc, "stream").body())
                yield DONE
                return
        if item is None:
            break
        index, response = item
        if index not in opened:
            opened.add(index)
            if (opening := framer.opening(index, include_usage)) is not None:
                yield event(opening)
        if response.HasField("delta"):
            if response.delta.text:
                yield event(framer.delta(index, response.delta.text, include_usage))
            continue
        end = response.end
        try:
            check_end(end)
        except Exception as exc:
            yield event(api_error(exc, "stream").body())
            yield DONE
            return
        usages[index] = end.usage
        yield event(framer.finish(index, end.finish_reason, include_usage))
    if include_usage:
        yield event(framer.usage(usages))
    yield DONE


class SseResponse:
    """An ASGI response that streams ``body`` and cancels it the moment the client disconnects.

    Starlette's StreamingResponse notices a gone client only at its next write under
    ASGI 2.4, so a queued turn would run on for a keep-alive period; here a second task
    listens for ``http.disconnect`` the whole time.
    """

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        self.body = body
        self.on_close = on_close
        self.status_code = 200

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        pump = asyncio.create_task(self._pump(send))
        gone = asyncio.create_task(until_disconnected(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pump.cancel()
            gone.cancel()
            await asyncio.gather(pump, gone, return_exceptions=True)
            await self.on_close()  # the turns still running are cancelled: the replicas free their rows

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        try:
            async for chunk in self.body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            return  # the client went away mid-write: nothing to tell it
