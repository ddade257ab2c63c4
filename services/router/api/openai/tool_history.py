"""A conversation's earlier function calls and their results → chat messages the template renders.

A client that ran a forced call sends it back with the function's result to get the final
answer: on chat, an assistant message's ``tool_calls`` and a ``tool`` message; on the
Responses API, ``function_call`` and ``function_call_output`` input items. This model's chat
template defines no tool calls, so they are rendered as the generic template renders any
role:

- an assistant's calls become its text, one ``{"name": …, "arguments": …}`` JSON object per
  line: exactly what the model writes for a ``required`` call (the replica's JSON separators
  are Python's defaults), so the model reads its own calls back as it wrote them;
- a result becomes a ``tool`` message (``<|im_start|>tool``), as vLLM renders it with a
  template that has no tool markup.

A result must answer a call made earlier in the conversation (OpenAI's own rule): a result
with no call is a client's mistake, and the model could not tell what it answers. A request
that continues a session carries only the new messages, so there the call may be in the
stored history and is not looked for.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.router.api.openai.errors import bad_request, utf8_text

#: The role a function's result is given in (common.proto's ChatMessage.role).
TOOL_ROLE = "tool"
#: The longest call id kept: ids are the client's (OpenAI's are ~30 characters).
MAX_CALL_ID_CHARS = 256


@dataclass(frozen=True)
class Call:
    """One function call an assistant made, as the client sent it back."""

    call_id: str
    name: str
    arguments: str


def call_text(calls: Sequence[Call]) -> str:
    """An assistant's calls as the text the model reads: one JSON object per call and line."""
    return "\n".join(
        json.dumps({"name": c.name, "arguments": _arguments_value(c.arguments)}, ensure_ascii=False)
        for c in calls
    )


def _arguments_value(arguments: str) -> Any:
    # The arguments are a JSON text; parsed, they render as the model writes JSON. Text that is
    # not JSON (a client's own call), or that Python's reader refuses (an integer of thousands
    # of digits, nesting past its recursion limit), stays the string it was.
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments


def string_field(item: dict[str, Any], name: str, where: str, limit: int | None = None) -> str:
    """``item[name]``: a non-empty string (of at most ``limit`` characters), else a 400 naming it."""
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{name}", f"{where}.{name}: must be a non-empty string")
    if limit is not None and len(value) > limit:
        raise bad_request(f"{where}.{name}", f"{where}.{name}: at most {limit} characters")
    return utf8_text(value, f"{where}.{name}")


@dataclass
class CallLedger:
    """The call ids made so far in a conversation, so each result can be checked against one."""

    ids: set[str] = field(default_factory=set)
    #: The request continues a stored conversation (``session_id``): the call a result answers
    #: may be in its history, which the request does not carry (only the new messages are sent).
    continues_history: bool = False

    def made(self, call: Call) -> None:
        self.ids.add(call.call_id)

    def check_result(self, call_id: str, where: str) -> None:
        if call_id not in self.ids and not self.continues_history:
            raise bad_request(
                where,
                f"{where}: {call_id[:64]!r} answers no call made earlier in the conversation "
                "(a function's result follows the assistant's call that asked for it)",
            )


def chat_calls(raw: Any, where: str) -> list[Call]:
    """Chat's ``tool_calls`` of an assistant message (``where`` names it) as calls."""
    if not isinstance(raw, list):
        raise bad_request(where, f"{where}: must be a list of tool calls")
    calls = []
    for j, entry in enumerate(raw):
        at = f"{where}[{j}]"
        if not isinstance(entry, dict) or entry.get("type", "function") != "function":
            raise bad_request(at, f"{at}: must be {{'id': …, 'type': 'function', 'function': {{…}}}}")
        function = entry.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{at}.function", f"{at}.function: must be {{'name': …, 'arguments': …}}")
        calls.append(
            Call(
                call_id=string_field(entry, "id", at, MAX_CALL_ID_CHARS),
                name=string_field(function, "name", f"{at}.function"),
                arguments=_arguments(function, f"{at}.function"),
            )
        )
    return calls


def responses_call(item: dict[str, Any], where: str) -> Call:
    """A Responses ``function_call`` input item as a call."""
    return Call(
        call_id=string_field(item, "call_id", where, MAX_CALL_ID_CHARS),
        name=string_field(item, "name", where),
        arguments=_arguments(item, where),
    )


def _arguments(holder: dict[str, Any], where: str) -> str:
    arguments = holder.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise bad_request(f"{where}.arguments", f"{where}.arguments: must be a string (the arguments' JSON)")
    return utf8_text(arguments, f"{where}.arguments")
