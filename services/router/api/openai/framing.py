"""OpenAI response bodies and SSE framing: whole answers, stream chunks, usage."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.api.openai.choices import ChoiceAnswer
from services.router.api.openai.errors import ApiError, ConstraintParam, api_error, renamed
from services.router.api.openai.structured import ToolMode, chat_logprobs, echo_logprobs, text_logprobs

SYSTEM_FINGERPRINT = "llm-mesh"
FINISH_REASONS: dict[int, str] = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
}
# A stream with event ids (a resumable one): a comment line with no blank line after it. A blank
# line would end an "event" with no data, which parsers that keep the last event id (as the SSE
# spec says, and the OpenAI SDKs do) hand on as an empty event, and the SDKs then fail to parse
# its "" as JSON.
KEEPALIVE_WITH_IDS = b": keep-alive\n"
# Any other stream: a blank line alone, which every parser skips. No id was ever set, so the SDKs
# dispatch nothing for it, and the load tools' line readers (`vllm bench serve`, SGLang's
# bench_serving, llmperf) drop empty lines, where a comment line broke SGLang's and llmperf's
# JSON parsing and vLLM's, glued to the next event, dropped that event's token.
KEEPALIVE = b"\n"
DONE = b"data: [DONE]\n\n"
Kind = Literal["chat", "text"]


#: Where a delta's text sits in its JSON is found with this text (only templates are built with it).
_TEXT_MARK = "\x00llm-mesh delta text\x00"


def dumps(payload: Any) -> str:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


def sse(event_id: str | None, payload: Any) -> bytes:
    """One SSE event; its id (request id + sequence number), when given, lets a client say where
    it got to. OpenAI's and vLLM's streams have none, and the load tools' parsers read each event
    as ``data:`` alone (an ``id:`` line failed every streamed request of `vllm bench serve` and
    SGLang's bench_serving), so only a stream that can be resumed carries them.

    ``payload``: a body to serialise, or a ``str`` that already is its JSON (``Framer.delta_json``).
    """
    data = payload if isinstance(payload, str) else dumps(payload)
    if event_id is None:
        return f"data: {data}\n\n".encode()
    return f"id: {event_id}\ndata: {data}\n\n".encode()


def usage_body(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def total_usage(usages: Mapping[int, common_pb2.Usage], per_prompt: int = 1) -> dict[str, Any]:
    """The n choices of one prompt read the same prompt: it counts once per prompt, as OpenAI counts it.

    ``usages`` is by choice index; choices ``[k * per_prompt, (k + 1) * per_prompt)`` share prompt k.
    Its cached tokens are the fewest any choice found: the first to run fills the prefix cache for
    the others, so the most would call nearly all of a brand-new prompt cached (608 of 620 at
    n = 2, measured), where OpenAI, reading the prompt once, says 0.
    """
    prompts: dict[int, tuple[int, int]] = {}
    for index, u in usages.items():
        k = index // per_prompt
        seen, cached = prompts.get(k, (0, u.cached_prompt_tokens))
        prompts[k] = (max(seen, u.prompt_tokens), min(cached, u.cached_prompt_tokens))
    completion = sum(u.completion_tokens for u in usages.values())
    return usage_body(sum(p for p, _ in prompts.values()), completion, sum(c for _, c in prompts.values()))


#: How a chunk framed for ``include_usage`` ends (``Framer._chunk``, and so every delta template).
_NULL_USAGE_END = ',"usage":null}'


class RunningUsage:
    """``stream_options.continuous_usage_stats``: the whole request's token counts so far, which
    every chunk of its stream carries (vLLM's extension).

    Counted as the final usage is (``total_usage``): completion tokens summed over the choices,
    each prompt once however many choices share it. A choice's completion tokens are the ids its
    deltas brought, then its TurnEnd's count. Its prompt's count comes with its first tokens
    (``TokenDelta.prompt_tokens``, the replica's count), then its TurnEnd's. A cached answer's
    deltas carry none, nor those of a replica older than the field: there the prompt counts 0
    until the choice ends (docs/openai.md says so).
    """

    def __init__(self, choices: int, per_prompt: int = 1, score_only: bool = False) -> None:
        self._prompt = [0] * choices
        self._completion = [0] * choices
        self._per_prompt = max(1, per_prompt)
        #: Echo with max_tokens 0: the replica's one drawn token is no answer, never counted.
        self._score_only = score_only

    def add_delta(self, index: int, delta: router_pb2.TokenDelta) -> None:
        # The replica's count, in an attempt's first delta; or one prompt logprob per prompt token.
        self._prompt[index] = max(self._prompt[index], delta.prompt_tokens, len(delta.prompt_logprobs))
        if not self._score_only:
            self._completion[index] += len(delta.token_ids)

    def add_end(self, index: int, usage: common_pb2.Usage) -> None:
        """The choice's final counts (a cached answer's deltas may carry no ids: its end says)."""
        self._prompt[index] = usage.prompt_tokens or self._prompt[index]
        self._completion[index] = 0 if self._score_only else usage.completion_tokens

    def body(self) -> dict[str, int]:
        prompts: dict[int, int] = {}
        for index, count in enumerate(self._prompt):
            k = index // self._per_prompt
            prompts[k] = max(prompts.get(k, 0), count)
        prompt, completion = sum(prompts.values()), sum(self._completion)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def with_running_usage(payload: dict[str, Any] | str, usage: Mapping[str, int]) -> dict[str, Any] | str:
    """A chunk framed with ``"usage": null`` (a body, or ``Framer.delta_json``'s text) carrying
    ``usage`` instead."""
    if isinstance(payload, str):
        # Filled in the JSON text, so the per-token template path stays a template.
        assert payload.endswith(_NULL_USAGE_END), "a chunk framed for include_usage"
        return payload[: -len("null}")] + dumps(usage) + "}"
    payload["usage"] = usage
    return payload


@dataclass(frozen=True)
class Framer:
    """Builds one request's bodies: ``chat.completion`` (chat) or ``text_completion`` (text)."""

    kind: Kind
    completion_id: str
    created: int
    model: str
    #: Choices per prompt (n): they share one prompt's tokens in the usage.
    per_prompt: int = 1
    #: Chat with tools: each answer is a function call, sent as ``tool_calls``.
    tool: ToolMode | None = None
    #: The request field its output constraint came from (a replica names the proto field).
    constraint: ConstraintParam | None = None
    #: Completions with ``echo``: each choice's prompt text (None: given as token ids); empty
    #: without echo.
    echo: tuple[str | None, ...] = ()
    #: Echo with ``max_tokens`` 0: the prompt scored, no answer. The replica drew one token (it
    #: always draws one), which no body shows or counts.
    score_only: bool = False
    #: The request's name for the answer's token limit (chat's ``max_completion_tokens``).
    max_tokens_field: str = "max_tokens"
    #: ``delta_json``'s templates by (choice, with usage): the JSON before and after the text.
    _delta_templates: dict[tuple[int, bool], tuple[str, str]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: A text stream's ``text_offset`` so far, by choice: each chunk's offsets go on from the
    #: last, as the whole body's do (a resumed stream remakes its events from the start).
    _text_offsets: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def error(self, exc: BaseException, route: str) -> ApiError:
        """What the client is told of ``exc``, a field named as this request named it."""
        error = api_error(exc, route)
        if self.kind == "chat":
            # A chat request has no `prompt`: the replica's prompt is its rendered messages.
            error = renamed(error, "prompt", "messages")
        else:
            # Token ids come in OpenAI's `prompt` field; the protos carry them apart.
            error = renamed(error, "prompt_token_ids", "prompt")
        error = renamed(error, "max_tokens", self.max_tokens_field)
        return self.constraint.rename(error) if self.constraint is not None else error

    def _head(self, object_name: str, model: str | None = None) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": object_name,
            "created": self.created,
            "model": model or self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }

    def whole(self, answers: Sequence[ChoiceAnswer]) -> dict[str, Any]:
        ends = [a.end for a in answers if a.end is not None]
        model = next((e.model for e in ends if e.model), None)
        choices = []
        for index, answer in enumerate(answers):
            reason = FINISH_REASONS.get(answer.end.finish_reason) if answer.end is not None else None
            logprobs = self._logprobs(answer.logprobs)
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": answer.text, "refusal": None}
                call = self.tool_call(index, answer.text)
                if call is not None:
                    message = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}
                    reason = "tool_calls" if reason == "stop" else reason
                choices.append(
                    {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
                )
            else:
                text, answered = answer.text, answer.logprobs
                if self.score_only:
                    text, answered, reason = "", [], "length" if reason else reason
                if self.echo:
                    text = self.echo_text(index, answer.prompt_logprobs, answer.prompt_text) + text
                    logprobs = (
                        echo_logprobs(answer.prompt_logprobs, answered) if logprobs is not None else None
                    )
                choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})
        body = self._head("chat.completion" if self.kind == "chat" else "text_completion", model)
        body["choices"] = choices
        body["usage"] = self._total_usage(
            {i: a.end.usage for i, a in enumerate(answers) if a.end is not None}
        )
        return body

    def _total_usage(self, usages: Mapping[int, common_pb2.Usage]) -> dict[str, Any]:
        if self.score_only:  # the token the replica drew is no answer
            usages = {
                i: common_pb2.Usage(
                    prompt_tokens=u.prompt_tokens, cached_prompt_tokens=u.cached_prompt_tokens
                )
                for i, u in usages.items()
            }
        return total_usage(usages, self.per_prompt)

    def _chunk(self, choice: dict[str, Any], with_usage: bool) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = [choice]
        if with_usage:
            body["usage"] = None  # OpenAI's shape when include_usage: null on all but the last chunk
        return body

    def opening(self, index: int, with_usage: bool) -> dict[str, Any] | None:
        """Chat streams open each choice with its role; text streams have no such chunk."""
        if self.kind != "chat":
            return None
        delta = {"role": "assistant", "content": ""}
        return self._chunk(
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}, with_usage
        )

    def delta(
        self, index: int, text: str, with_usage: bool, logprobs: Sequence[common_pb2.TokenLogprobs] = ()
    ) -> dict[str, Any]:
        lp = self._logprobs(logprobs, index)
        if self.kind == "chat":
            choice = {"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": None}
        return self._chunk(choice, with_usage)

    def echo_text(self, index: int, prompt: Sequence[common_pb2.TokenLogprobs], decoded: str) -> str:
        """Choice ``index``'s prompt as echoed: as sent, or, sent as ids, as the replica decoded
        them (``decoded``; a replica from before ``prompt_text`` sends none: its tokens' texts)."""
        given = self.echo[index]
        if given is not None:
            return given
        return decoded or "".join(t.text for t in prompt)

    def echo_delta(self, index: int, delta: router_pb2.TokenDelta, with_usage: bool) -> dict[str, Any]:
        """A stream's first delta of an echoed choice: its prompt, then the delta's own text, in one
        event (so a resumed stream's event ids still count one event per relayed message)."""
        answered = not self.score_only
        text = self.echo_text(index, delta.prompt_logprobs, delta.prompt_text) + (
            delta.text if answered else ""
        )
        lp = None
        if delta.logprobs:
            echoed = [*delta.prompt_logprobs, *(delta.logprobs if answered else ())]
            lp = echo_logprobs(delta.prompt_logprobs, delta.logprobs if answered else ())
            self._text_offsets[index] = sum(len(t.text) for t in echoed)
        return self._chunk({"index": index, "text": text, "logprobs": lp, "finish_reason": None}, with_usage)

    def delta_json(self, index: int, text: str, with_usage: bool) -> str:
        """``dumps(self.delta(index, text, with_usage))`` for a delta without logprobs, made by
        filling a template: the chunks of one choice differ only in their text, and building and
        serialising the whole body for every relayed token was most of the HTTP front's own
        per-token cost (5.6 µs against 1 here; bench/serving_front.py measures the front)."""
        template = self._delta_templates.get((index, with_usage))
        if template is None:
            head, mark, tail = dumps(self.delta(index, _TEXT_MARK, with_usage)).partition(dumps(_TEXT_MARK))
            assert mark, "the text's place in the chunk"
            template = self._delta_templates[(index, with_usage)] = (head, tail)
        return template[0] + dumps(text) + template[1]

    def _logprobs(
        self, tokens: Sequence[common_pb2.TokenLogprobs], index: int | None = None
    ) -> dict[str, Any] | None:
        """A choice's ``logprobs`` (null unless the request asked and tokens came): a whole
        answer's, or with ``index`` the next chunk's of that choice's stream."""
        if not tokens:
            return None
        if self.kind == "chat":
            return chat_logprobs(tokens)
        if index is None:
            return text_logprobs(tokens)
        offset = self._text_offsets.get(index, 0)
        self._text_offsets[index] = offset + sum(len(t.text) for t in tokens)
        return text_logprobs(tokens, offset)

    def tool_call(self, index: int, text: str) -> dict[str, Any] | None:
        """Choice ``index``'s ``tool_calls`` entry, when the request has a tool mode and the text is a call."""
        return None if self.tool is None else self.tool.call(text, f"call_{self.completion_id}_{index}")

    def tool_delta(
        self, index: int, text: str, with_usage: bool, logprobs: Sequence[common_pb2.TokenLogprobs] = ()
    ) -> dict[str, Any] | None:
        """A stream's whole call as one delta (sent once the answer ended), with the call's token
        logprobs when asked (the whole answer has them), or None if it is no call."""
        call = self.tool_call(index, text)
        if call is None:
            return None
        delta = {"tool_calls": [{"index": 0, **call}]}
        lp = self._logprobs(logprobs, index)
        return self._chunk(
            {"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}, with_usage
        )

    def finish(self, index: int, reason: int, with_usage: bool, called: bool = False) -> dict[str, Any]:
        """The choice's last chunk; ``called``: its answer was sent as a call (``tool_delta``)."""
        name = FINISH_REASONS.get(reason)
        if called and name == "stop":
            name = "tool_calls"
        if self.score_only and name is not None:
            name = "length"  # max_tokens 0 reached at once
        if self.kind == "chat":
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": name}
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": name}
        return self._chunk(choice, with_usage)

    def usage(self, usages: Mapping[int, common_pb2.Usage]) -> dict[str, Any]:
        """The last chunk of a stream that asked for ``stream_options.include_usage``: no choices."""
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = []
        body["usage"] = self._total_usage(usages)
        return body
