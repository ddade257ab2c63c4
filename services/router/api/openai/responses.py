"""``POST /v1/responses`` bodies → one chat turn: OpenAI's Responses API over the same pipeline as chat.

The Responses API is what OpenAI's newer SDK helpers, the Agents SDK and LangChain's
``ChatOpenAI(use_responses_api=True)`` send. Its ``instructions`` and ``input`` messages are a
chat conversation (``instructions`` first, as a system message), ``max_output_tokens`` is
``max_tokens``, and ``text.format`` is chat's ``response_format`` flattened; so a response is a
chat turn, and the one pipeline serves both (sessions, RAG, caches, placement, failover).

Function tools work as chat's do: a forced call (``tool_choice`` ``required`` or a named
function) is an answer constrained to the function's parameters, returned as a
``function_call`` output item; ``auto`` with tools is refused, as on chat, since this model's
chat template defines no tool calls.

What a stateless router cannot honour is refused by name, never ignored: responses are not
stored, so ``previous_response_id`` and ``conversation`` are a 400 (send the conversation as
``input``), and so are built-in tools, tool results in ``input``, reasoning, background runs and
non-text inputs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.gen.llmmesh.v1 import common_pb2
from services.router.api.openai.errors import ApiError, bad_request, renamed, unsupported, utf8_text
from services.router.api.openai.extras import FIELDS as EXTRA_FIELDS
from services.router.api.openai.params import (
    INT32_MAX,
    ROLE_NAMES,
    Generation,
    constraint_param,
    int_field,
    json_object,
    message_text,
    refuse_unsupported,
    sampling_params,
    turns_generation,
)
from services.router.api.openai.structured import ToolMode, apply_output_options, tool_mode
from services.router.api.openai.tool_history import (
    MAX_CALL_ID_CHARS,
    TOOL_ROLE,
    Call,
    CallLedger,
    call_text,
    responses_call,
    string_field,
)

#: The ``include`` value that asks for the answer's token logprobs (with ``top_logprobs`` alternatives).
LOGPROBS_INCLUDE = "message.output_text.logprobs"

_KNOWN = (
    frozenset(
        {
            "model",
            "input",
            "instructions",
            "max_output_tokens",
            "temperature",
            "top_p",
            "top_logprobs",
            "include",
            "stream",
            "text",
            "tools",
            "tool_choice",
            "previous_response_id",
            "conversation",
            "reasoning",
            "background",
            "truncation",
            "prompt",
            "max_tool_calls",
            # vLLM's sampling extras, as its own /v1/responses takes them.
            "top_k",
            "seed",
            "repetition_penalty",
            "stop",
            # Chat's additive penalties and bias: the engine has them, so a client that sends them
            # here gets them rather than a silently different answer.
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "min_tokens",
            "stop_token_ids",
            "min_p",
            "include_stop_str_in_output",
            "allowed_token_ids",
            "bad_words",
        }
    )
    | EXTRA_FIELDS
)

# Fields the Responses API has that would change the answer, refused unless null or neutral.
_WHY_NOT: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((), "responses are not stored here; send the whole conversation as input"),
    "conversation": ((), "conversations are not stored here; send the whole conversation as input"),
    "prompt": ((), "stored prompt templates are not supported; send instructions and input"),
    "background": ((False,), "background responses are not supported; use the task API (docs/tasks.md)"),
    "truncation": (("disabled",), "only 'disabled': an input over the context is a 400, never cut"),
    "n": ((1,), "a response has one answer"),
    "resumable": ((False,), "only chat and completions streams resume (Last-Event-ID)"),
}
#: Text parts of input messages: the user's, and an earlier answer's as a client sends it back.
_TEXT_PARTS = frozenset({"input_text", "output_text"})


@dataclass(frozen=True)
class ResponseRequest:
    """One ``/v1/responses`` request: its turn, and what its response object echoes back."""

    generation: Generation
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    #: ``text`` as the response echoes it (its ``format`` defaulted to plain text).
    text: dict[str, Any]
    metadata: dict[str, str]
    user: str | None
    #: The answer's token logprobs were asked for (``include``).
    logprobs: bool
    #: ``tools`` and ``tool_choice`` as the response echoes them.
    tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tool_choice: Any = "auto"


def response_generation(body: Any, request_id: str) -> ResponseRequest:
    """A ``POST /v1/responses`` body as one chat turn; a 400 naming the field otherwise."""
    body = json_object(body)
    _refuse_stateful(body)
    reasoning = body.get("reasoning")
    if reasoning is not None and (
        not isinstance(reasoning, dict)
        or any(v is not None and (k, v) != ("effort", "none") for k, v in reasoning.items())
    ):
        raise unsupported(
            "reasoning", "this model does not reason before it answers; send null or effort 'none'"
        )
    # Chat's own rules for every field the two APIs share (and the unknown ones, logged once).
    shared = {
        k: v for k, v in body.items() if k not in _WHY_NOT and k not in ("tools", "tool_choice", "reasoning")
    }
    refuse_unsupported(shared, _KNOWN)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions", "instructions: must be a string")
    messages = (
        [common_pb2.ChatMessage(role="system", content=utf8_text(instructions, "instructions"))]
        if instructions
        else []
    )
    messages += _input_messages(body.get("input"), continues_history=body.get("session_id") is not None)
    max_tokens = int_field(body, "max_output_tokens", 1, INT32_MAX)
    sampling = sampling_params(body, max_tokens)
    logprobs = _logprobs_included(body.get("include"))
    source = _output_options(body, sampling, logprobs)
    tool = _tool_mode(body, sampling)
    if tool is not None:
        # The constraint is the called function's parameters schema, named as this API has it.
        source = _responses_field(tool.source)
    generation = turns_generation(body, request_id, [messages], sampling)
    generation = dataclasses.replace(generation, tool=tool, constraint=constraint_param(sampling, source))
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise bad_request("metadata", "metadata: must be an object of strings")
    user = body.get("user")
    return ResponseRequest(
        generation=generation,
        instructions=instructions,
        max_output_tokens=max_tokens,
        temperature=sampling.temperature if sampling.HasField("temperature") else 1.0,
        top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
        text=_echoed_text(body.get("text")),
        metadata=dict(metadata or {}),
        user=user if isinstance(user, str) else None,
        logprobs=logprobs,
        tools=list(body.get("tools") or []),
        tool_choice=body.get("tool_choice") or "auto",
    )


def _tool_mode(body: Mapping[str, Any], sampling: common_pb2.SamplingParams) -> ToolMode | None:
    """``tools`` and ``tool_choice`` through chat's rules (``structured.tool_mode``): the Responses
    API's flat function tools in chat's nested shape, errors naming this API's fields."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("tools", "tools: must be a list")
    chat_tools = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{i}]", f"tools[{i}]: must be an object")
        if tool.get("type") != "function":
            raise unsupported(
                f"tools[{i}].type",
                f"only function tools: this server runs no built-in tool ({str(tool.get('type'))[:64]!r})",
            )
        function = {"name": tool.get("name"), "parameters": tool.get("parameters", {"type": "object"})}
        chat_tools.append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if choice == "auto" and not chat_tools:
        choice = None  # OpenAI's default, sent by clients with no tools: nothing to call
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise unsupported(
                "tool_choice",
                "only 'none', 'required' or {'type': 'function', 'name': …} (no built-in tools)",
            )
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    try:
        return tool_mode({"tools": chat_tools, "tool_choice": choice}, sampling)
    except ApiError as error:
        if error.param is not None:
            error = renamed(error, error.param, _responses_field(error.param))
        if error.param is not None and _TOOL_ENTRY.fullmatch(error.param):
            error = dataclasses.replace(
                error, message=f"{error.param}: must be {{'type': 'function', 'name': …, 'parameters': …}}"
            )
        raise error from None


_TOOL_ENTRY = re.compile(r"tools\[\d+\]")
_CHAT_TOOL_FIELD = re.compile(r"^(tools\[\d+\]|tool_choice)\.function\.")


def _responses_field(chat_field: str) -> str:
    """A chat tools field as this API names it, its functions flat: ``tools[i].function.parameters``
    is ``tools[i].parameters``, ``tool_choice.function.name`` is ``tool_choice.name``."""
    return _CHAT_TOOL_FIELD.sub(r"\1.", chat_field)


def _refuse_stateful(body: Mapping[str, Any]) -> None:
    for name, (neutral, why) in _WHY_NOT.items():
        value = body.get(name)
        if value is not None and not any(value == a and type(value) is type(a) for a in neutral):
            raise unsupported(name, why)


def _input_messages(raw: Any, continues_history: bool = False) -> list[common_pb2.ChatMessage]:
    """``input``: a user's text, or a list of items: messages (the easy form and the typed one),
    and the function calls made earlier with their outputs (``tool_history``)."""
    if isinstance(raw, str):
        if not raw:
            raise bad_request("input", "input: must not be empty")
        return [common_pb2.ChatMessage(role="user", content=utf8_text(raw, "input"))]
    if not isinstance(raw, list) or not raw:
        raise bad_request("input", "input: required, a string or a non-empty list of messages")
    out: list[common_pb2.ChatMessage] = []
    ledger = CallLedger(continues_history=continues_history)
    calls: list[Call] = []  # consecutive function_call items: one assistant turn's calls
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(where, f"{where}: must be an object")
        kind = item.get("type", "message")
        if kind == "function_call":
            call = responses_call(item, where)
            utf8_text(call_text([call]), where)  # escaped lone surrogates in its arguments' JSON
            ledger.made(call)
            calls.append(call)
            continue
        if calls:
            out.append(common_pb2.ChatMessage(role="assistant", content=call_text(calls)))
            calls = []
        if kind == "function_call_output":
            call_id = string_field(item, "call_id", where, MAX_CALL_ID_CHARS)
            ledger.check_result(call_id, f"{where}.call_id")
            output = item.get("output")
            text = message_text(output, where, _TEXT_PARTS) if isinstance(output, list) else output
            if not isinstance(text, str):
                raise bad_request(
                    f"{where}.output", f"{where}.output: must be a string or a list of text parts"
                )
            out.append(common_pb2.ChatMessage(role=TOOL_ROLE, content=utf8_text(text, f"{where}.output")))
            continue
        if kind != "message":
            raise unsupported(
                f"{where}.type",
                f"only message, function_call and function_call_output items are supported, not "
                f"{str(kind)[:64]!r}",
            )
        role = item.get("role")
        if not isinstance(role, str) or role not in ROLE_NAMES:
            raise bad_request(
                f"{where}.role", f"{where}.role: must be one of system, developer, user, assistant"
            )
        out.append(
            common_pb2.ChatMessage(
                role=ROLE_NAMES[role], content=message_text(item.get("content"), where, _TEXT_PARTS)
            )
        )
    if calls:
        out.append(common_pb2.ChatMessage(role="assistant", content=call_text(calls)))
    return out


def _logprobs_included(include: Any) -> bool:
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise bad_request("include", "include: must be a list of strings")
    # The other values name outputs this server never makes (tool results, encrypted reasoning).
    return LOGPROBS_INCLUDE in include


def _output_options(
    body: Mapping[str, Any], sampling: common_pb2.SamplingParams, logprobs: bool
) -> str | None:
    """``text.format`` and logprobs through chat's own rules, errors naming this API's fields."""
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise bad_request("text", "text: must be an object")
    text = text or {}
    if text.get("verbosity") not in (None, "medium"):
        raise unsupported("text.verbosity", "only 'medium': the answer's length is max_output_tokens'")
    fmt = text.get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format", "text.format: must be an object")
    chat: dict[str, Any] = {"logprobs": logprobs, "top_logprobs": body.get("top_logprobs")}
    if fmt and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    elif fmt:
        chat["response_format"] = {"type": fmt.get("type")}
    if chat["top_logprobs"] and not logprobs:
        raise bad_request("top_logprobs", f"top_logprobs: needs include: [{LOGPROBS_INCLUDE!r}]")
    try:
        source = apply_output_options(chat, sampling, chat=True)
    except ApiError as error:
        for chat_name, ours in (
            ("response_format.json_schema.schema", "text.format.schema"),
            ("response_format.type", "text.format.type"),
            ("response_format", "text.format"),
        ):
            error = renamed(error, chat_name, ours)
        raise error from None
    return {"response_format.json_schema.schema": "text.format.schema", "response_format": "text.format"}.get(
        source or "", source
    )


def _echoed_text(text: Any) -> dict[str, Any]:
    fmt = text.get("format") if isinstance(text, dict) else None
    return {"format": fmt if isinstance(fmt, dict) else {"type": "text"}}
