"""Server-sent events: chunks as tokens arrive, keep-alives while waiting, cancel when the client leaves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any

from services.gen.llmmesh.v1 import common_pb2
from services.router.api.openai.choices import ChoiceEvent, ChoiceStreams, check_end
from services.router.api.openai.errors import bad_request
from services.router.api.openai.extras import response_extras
from services.router.api.openai.framing import (
    DONE,
    KEEPALIVE,
    KEEPALIVE_WITH_IDS,
    Framer,
    RunningUsage,
    sse,
    with_running_usage,
)

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


def event_id(completion_id: str, counts: Sequence[int]) -> str:
    """``<completion id>-<k>``: k events of the (only) choice so far; with n choices ``-<k0>.<k1>…``.

    A count per choice, because the choices' events interleave as their tokens happen to
    arrive, which a replay cannot repeat; each choice's own events it can, exactly.
    """
    return f"{completion_id}-{'.'.join(str(c) for c in counts)}"


def parse_event_id(raw: str, prefix: str, choices: int) -> tuple[str, list[int]]:
    """``Last-Event-ID`` → (the request id, events seen per choice); a 400 naming the header otherwise."""
    head, _, tail = raw.strip().rpartition("-")
    try:
        counts = [int(c) for c in tail.split(".")]
    except ValueError:
        counts = []
    if not head.startswith(prefix) or len(head) == len(prefix) or not counts or min(counts) < 0:
        raise bad_request("Last-Event-ID", f"header Last-Event-ID: not an event id of this endpoint: {raw!r}")
    if len(counts) != choices:
        raise bad_request(
            "Last-Event-ID",
            f"header Last-Event-ID: {raw!r} counts {len(counts)} choices, the request has {choices}"
            " (resume with the same body)",
        )
    return head[len(prefix) :], counts


def sse_body(
    streams: ChoiceStreams,
    framer: Framer,
    first: ChoiceEvent | NoEventYet,
    include_usage: bool,
    keepalive_s: float,
    seen: Sequence[int] | None = None,
    with_extras: bool = False,
    with_ids: bool = False,
    continuous_usage: bool = False,
) -> AsyncIterator[bytes]:
    """``_events`` without the events a resuming client already has (a stream not resumed has
    none to drop, and takes no extra generator per event). ``with_ids``: each event carries its
    id (a resumable or resumed stream). ``continuous_usage`` (with ``include_usage``): every
    chunk carries the request's usage so far."""
    running = (
        RunningUsage(streams.count, framer.per_prompt, framer.score_only)
        if include_usage and continuous_usage
        else None
    )
    events = _events(streams, framer, first, include_usage, keepalive_s, seen, with_extras, with_ids, running)
    return events if seen is None else _unseen(events)


async def _unseen(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    async for chunk in events:
        if chunk:
            yield chunk


async def _events(
    streams: ChoiceStreams,
    framer: Framer,
    first: ChoiceEvent | NoEventYet,
    include_usage: bool,
    keepalive_s: float,
    seen: Sequence[int] | None,
    with_extras: bool,
    with_ids: bool,
    running: RunningUsage | None = None,
) -> AsyncIterator[bytes]:
    """The whole event stream of one request: every choice's chunks, usage if asked, then [DONE].

    ``seen``: events per choice the client already has (from its ``Last-Event-ID``): the
    messages are replayed from the start, and each choice's events are made again exactly
    as they were, but sent only after that count. The usage chunk counts as choice 0's.

    ``running``: every choice chunk carries the request's usage so far (``continuous_usage_stats``),
    its counts taken before the chunk is made, so a delta's own tokens are in its usage. The
    counts come from the messages alone, so a resumed stream remakes them exactly.
    """
    choices = streams.count
    counts = [0] * choices
    had = list(seen) if seen is not None else [0] * choices
    keepalive = KEEPALIVE_WITH_IDS if with_ids else KEEPALIVE

    def event(index: int, payload: Any, counted: bool = True) -> bytes:
        """``counted``: a choice's chunk, which carries the running usage when asked for (not an
        in-band error, nor the last chunk with the final usage)."""
        counts[index] += 1
        if counts[index] <= had[index]:
            return b""  # the client had this one before it reconnected
        if counted and running is not None:
            payload = with_running_usage(payload, running.body())
        if not with_ids:
            return sse(None, payload)
        return sse(
            event_id(framer.completion_id, [max(c, h) for c, h in zip(counts, had, strict=True)]), payload
        )

    opened: set[int] = set()
    usages: dict[int, common_pb2.Usage] = {}
    calls: dict[int, str] = {}  # tool mode: each choice's answer so far
    call_logprobs: dict[int, list[common_pb2.TokenLogprobs]] = {}  # …and its logprobs, if asked
    pending: ChoiceEvent | None = None
    if isinstance(first, NoEventYet):
        yield keepalive
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
                yield keepalive
                continue
            except Exception as exc:
                # The status line is long gone: the error goes in-band, as OpenAI's own streams send it.
                yield event(streams.last_index, framer.error(exc, "stream").body(), counted=False)
                yield DONE
                return
        if item is None:
            break
        index, response = item
        if index not in opened:
            opened.add(index)
            if (opening := framer.opening(index, include_usage)) is not None:
                yield event(index, opening)
        if response.HasField("delta"):
            if running is not None:
                running.add_delta(index, response.delta)
            if framer.tool is not None:
                # A call is sent whole once it ended: its name may come last (``required``).
                calls[index] = calls.get(index, "") + response.delta.text
                if response.delta.logprobs:  # sent with the call, as the whole answer has them
                    call_logprobs.setdefault(index, []).extend(response.delta.logprobs)
            elif framer.echo and response.delta.prompt_logprobs:
                yield event(index, framer.echo_delta(index, response.delta, include_usage))
            elif framer.score_only:
                pass  # max_tokens 0: the replica's one token is no answer
            elif response.delta.logprobs:
                yield event(
                    index, framer.delta(index, response.delta.text, include_usage, response.delta.logprobs)
                )
            elif response.delta.text:
                yield event(index, framer.delta_json(index, response.delta.text, include_usage))
            continue
        end = response.end
        try:
            check_end(end)
        except Exception as exc:
            yield event(index, framer.error(exc, "stream").body(), counted=False)
            yield DONE
            return
        usages[index] = end.usage
        if running is not None:
            running.add_end(index, end.usage)
        call = None
        if framer.tool is not None:
            held = calls.get(index, "")
            call = framer.tool_delta(index, held, include_usage, call_logprobs.get(index, ()))
            if call is not None:
                yield event(index, call)
            elif held:
                # No call (a `required` one cut short by max_tokens): its text, as the whole
                # answer gives it, never dropped.
                yield event(index, framer.delta_json(index, held, include_usage))
        finish = framer.finish(index, end.finish_reason, include_usage, called=call is not None)
        if with_extras:
            finish["llm_mesh"] = response_extras(end)
        yield event(index, finish)
    if include_usage:
        yield event(0, framer.usage(usages), counted=False)
    yield DONE


class SseResponse:
    """An ASGI response that streams ``body`` and cancels it the moment the client disconnects.

    Starlette's StreamingResponse notices a gone client only at its next write under
    ASGI 2.4, so a queued turn would run on for a keep-alive period; here a second task
    listens for ``http.disconnect`` the whole time.
    """

    def __init__(
        self,
        body: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.body = body
        self.on_close = on_close
        self.status_code = 200
        self.headers = SSE_HEADERS + [(k.encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        pump = asyncio.create_task(self._pump(send))
        gone = asyncio.create_task(until_disconnected(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pump.cancel()
            gone.cancel()
            await asyncio.gather(pump, gone, return_exceptions=True)
            # The turns still running are cancelled (the replicas free their rows), or, for a
            # resumable stream, left to finish into the replay buffer.
            await self.on_close()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        try:
            async for chunk in self.body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            return  # the client went away mid-write: nothing to tell it
