"""Response objects and the Responses API's typed stream events (``response.output_text.delta``, …).

A response holds one output item: the assistant's message, with one ``output_text`` part, or,
for a forced tool call, a ``function_call``. Its stream is the event sequence OpenAI's own sends
and its SDKs' stream helpers check, in order: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per relayed message, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it). A call comes whole once the answer
ended, as chat streams it (a ``required`` call's name is known only then): its item added, one
``response.function_call_arguments.delta``, ``….done``, the item done. Every event carries its
``sequence_number``. A failure after the stream began is an ``error`` event and
``response.failed``. There is no ``[DONE]``: the Responses API ends with the stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.api.openai.choices import ChoiceAnswer, ChoiceEvent, ChoiceStreams, check_end
from services.router.api.openai.errors import ApiError, ConstraintParam, api_error, renamed
from services.router.api.openai.extras import response_extras
from services.router.api.openai.framing import KEEPALIVE, dumps
from services.router.api.openai.responses import ResponseRequest
from services.router.api.openai.streaming import NoEventYet
from services.router.api.openai.structured import chat_logprobs


def sse_event(payload: dict[str, Any]) -> bytes:
    """One typed event: its ``event:`` line names its type, as OpenAI's own stream does."""
    return f"event: {payload['type']}\ndata: {dumps(payload)}\n\n".encode()


@dataclass
class ResponseFramer:
    """Builds one request's response objects and stream events."""

    request: ResponseRequest
    response_id: str
    created_at: int
    model: str
    _sequence: int = field(default=0, init=False)

    @property
    def item_id(self) -> str:
        return "msg_" + self.response_id.removeprefix("resp_")

    @property
    def call_item_id(self) -> str:
        return "fc_" + self.response_id.removeprefix("resp_")

    def error(self, exc: BaseException, route: str) -> ApiError:
        """What the client is told of ``exc``: the replica's ``messages`` (``prompt`` from a replica
        before 885ca27) is this request's ``input``, its ``max_tokens`` this request's
        ``max_output_tokens``."""
        error = renamed(api_error(exc, route), "prompt", "input")
        error = renamed(error, "messages", "input")
        error = renamed(error, "max_tokens", "max_output_tokens")
        constraint: ConstraintParam | None = self.request.generation.constraint
        return constraint.rename(error) if constraint is not None else error

    # -- objects

    def response(
        self,
        status: str,
        text: str | None = None,
        end: router_pb2.TurnEnd | None = None,
        logprobs: Sequence[common_pb2.TokenLogprobs] = (),
        error: ApiError | None = None,
    ) -> dict[str, Any]:
        """The response object; ``text`` None: no output yet (in progress, or failed before any)."""
        r = self.request
        incomplete = status == "incomplete"
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None if error is None else {"code": error.code or error.type, "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": None,
            "model": (end.model if end is not None and end.model else None) or self.model,
            "output": [] if text is None else [self.output_item(text, _item_status(status), logprobs)],
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": r.temperature,
            "text": r.text,
            "tool_choice": r.tool_choice,
            "tools": r.tools,
            "top_logprobs": r.generation.turns[0].sampling.top_logprobs if r.logprobs else None,
            "top_p": r.top_p,
            "truncation": "disabled",
            "usage": None if end is None else usage(end.usage),
            "user": r.user,
            "metadata": r.metadata,
        }

    def output_item(
        self, text: str, status: str, logprobs: Sequence[common_pb2.TokenLogprobs] = ()
    ) -> dict[str, Any]:
        """The answer as its output item: a function call when the request forced one and the text
        is one (a ``required`` call cut short is not: it stays the text it is), else the message."""
        call = self.function_call(text, status)
        return call if call is not None else self.message(text, status, logprobs)

    def function_call(self, text: str, status: str) -> dict[str, Any] | None:
        tool = self.request.generation.tool
        if tool is None:
            return None
        call = tool.call(text, "call_" + self.response_id.removeprefix("resp_"))
        if call is None:
            return None
        function = call["function"]
        return {
            "id": self.call_item_id,
            "type": "function_call",
            "status": status,
            "call_id": call["id"],
            "name": function["name"],
            "arguments": function["arguments"],
        }

    def message(
        self, text: str, status: str, logprobs: Sequence[common_pb2.TokenLogprobs] = ()
    ) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [] if status == "in_progress" else [self.part(text, logprobs)],
        }

    def part(self, text: str, logprobs: Sequence[common_pb2.TokenLogprobs] = ()) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": token_logprobs(logprobs)}

    def whole(self, answer: ChoiceAnswer) -> dict[str, Any]:
        end = answer.end
        assert end is not None
        return self.finished(_status(end.finish_reason), answer.text, end, answer.logprobs)

    def finished(
        self, status: str, text: str, end: router_pb2.TurnEnd, logprobs: Sequence[common_pb2.TokenLogprobs]
    ) -> dict[str, Any]:
        """The response once its turn ended; with llm-mesh's extras (session, RAG, cache) when the
        request used any, as chat's last chunk carries them."""
        body = self.response(status, text, end, logprobs)
        if self.request.generation.extras.any:
            body["llm_mesh"] = response_extras(end)
        return body

    # -- events

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(payload)

    def _text_event(self, kind: str, **fields: Any) -> bytes:
        return self.event(kind, item_id=self.item_id, output_index=0, content_index=0, **fields)

    def _message_opened(self) -> list[bytes]:
        return [
            self.event("response.output_item.added", output_index=0, item=self.message("", "in_progress")),
            self._text_event("response.content_part.added", part=self.part("")),
        ]

    def _delta(self, text: str, logprobs: Sequence[common_pb2.TokenLogprobs]) -> bytes:
        return self._text_event("response.output_text.delta", delta=text, logprobs=token_logprobs(logprobs))

    def _item_closed(
        self, text: str, status: str, logprobs: Sequence[common_pb2.TokenLogprobs], opened: bool
    ) -> list[bytes]:
        """The output item's closing events (its opening too, unless sent while it streamed)."""
        call = self.function_call(text, status)
        if call is not None:
            fields = {"item_id": call["id"], "output_index": 0}
            return [
                self.event(
                    "response.output_item.added",
                    output_index=0,
                    item={**call, "arguments": "", "status": "in_progress"},
                ),
                self.event("response.function_call_arguments.delta", delta=call["arguments"], **fields),
                self.event(
                    "response.function_call_arguments.done",
                    arguments=call["arguments"],
                    name=call["name"],
                    **fields,
                ),
                self.event("response.output_item.done", output_index=0, item=call),
            ]
        opening = [] if opened else [*self._message_opened(), self._delta(text, logprobs)]
        return [
            *opening,
            self._text_event("response.output_text.done", text=text, logprobs=token_logprobs(logprobs)),
            self._text_event("response.content_part.done", part=self.part(text, logprobs)),
            self.event(
                "response.output_item.done", output_index=0, item=self.message(text, status, logprobs)
            ),
        ]

    async def events(
        self, streams: ChoiceStreams, first: ChoiceEvent | NoEventYet, keepalive_s: float
    ) -> AsyncIterator[bytes]:
        """The whole stream of one response."""
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))
        # A forced call is held until the answer ends (chat's rule); text streams as it comes.
        live = self.request.generation.tool is None
        if live:
            for chunk in self._message_opened():
                yield chunk
        parts: list[str] = []
        logprobs: list[common_pb2.TokenLogprobs] = []
        pending = None if isinstance(first, NoEventYet) else first
        if pending is None:
            yield KEEPALIVE
        while True:
            item: ChoiceEvent | None
            if pending is not None:
                item, pending = pending, None
            else:
                try:
                    item = await streams.next(keepalive_s)
                except TimeoutError:
                    yield KEEPALIVE  # queued or a slow prefill: keeps proxies from timing out
                    continue
                except Exception as exc:
                    for chunk in self._failed(exc, "".join(parts)):
                        yield chunk
                    return
            if item is None:
                return  # cannot happen: every turn ends with its TurnEnd
            response = item[1]
            if response.HasField("delta"):
                delta = response.delta
                if delta.text or delta.logprobs:
                    parts.append(delta.text)
                    logprobs.extend(delta.logprobs)
                    if live:
                        yield self._delta(delta.text, delta.logprobs)
                continue
            end = response.end
            try:
                check_end(end)
            except Exception as exc:
                for chunk in self._failed(exc, "".join(parts)):
                    yield chunk
                return
            text = "".join(parts)
            status = _status(end.finish_reason)
            for chunk in self._item_closed(text, _item_status(status), logprobs, opened=live):
                yield chunk
            yield self.event(f"response.{status}", response=self.finished(status, text, end, logprobs))
            return

    def _failed(self, exc: BaseException, text: str) -> list[bytes]:
        """The status line is long gone: the error goes in-band, then the response fails."""
        error = self.error(exc, "stream")
        return [
            self.event("error", code=error.code, message=error.message, param=error.param),
            self.event("response.failed", response=self.response("failed", text or None, error=error)),
        ]


def _status(finish_reason: int) -> str:
    return "incomplete" if finish_reason == common_pb2.FINISH_REASON_LENGTH else "completed"


def usage(u: common_pb2.Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def token_logprobs(tokens: Sequence[common_pb2.TokenLogprobs]) -> list[dict[str, Any]]:
    """``output_text.logprobs``: chat's per-token entries (token, logprob, bytes, top_logprobs)."""
    return chat_logprobs(tokens)["content"] if tokens else []


def _item_status(status: str) -> str:
    """The message's status in a response of ``status``: a failed one keeps the text its stream
    had sent, as an unfinished message."""
    return "completed" if status == "completed" else "incomplete"
