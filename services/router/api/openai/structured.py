"""OpenAI's structured-output and logprobs fields → the engine's constraint and logprobs.

``response_format`` (``text``, ``json_object``, ``json_schema``), vLLM's ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` extras, and ``logprobs`` /
``top_logprobs`` map onto ``SamplingParams``; whether a schema, regex or grammar
compiles is the replica's answer (INVALID_ARGUMENT, a 400 naming the field). ``tools`` with
``tool_choice`` ``required`` or a named function become a JSON-schema constraint (the call's
arguments constrained to the function's ``parameters``) and a ``ToolMode`` that answers with
``tool_calls``; ``auto`` is a 400 (this model's chat template defines no tool calls, so the
model cannot choose between answering and calling).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.sampling_limits import MAX_CHOICES
from services.gen.llmmesh.v1 import common_pb2
from services.router.api.openai.errors import bad_request, unsupported

MAX_TOP_LOGPROBS = 20
#: The request fields this module reads (params.py leaves them to it).
FIELDS = frozenset(
    {
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "logprobs",
        "top_logprobs",
    }
)


def apply_output_options(
    body: Mapping[str, Any], sampling: common_pb2.SamplingParams, chat: bool
) -> str | None:
    """Set ``sampling``'s constraint and logprobs from ``body``; a 400 naming the field otherwise.
    Returns the request field the constraint came from (None without one), for the replica's
    refusals to name it (``errors.ConstraintParam``)."""
    source = _constraint(body, sampling)
    _logprobs(body, sampling, chat)
    return source


def _constraint(body: Mapping[str, Any], sampling: common_pb2.SamplingParams) -> str | None:
    given = [name for name in sorted(FIELDS - {"logprobs", "top_logprobs"}) if body.get(name) is not None]
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") == "text"):
        if not isinstance(fmt, dict):
            raise bad_request("response_format", "response_format: must be an object")
        given.remove("response_format")  # plain text: no constraint
    if len(given) > 1:
        raise bad_request(given[1], f"{given[1]}: only one of {', '.join(given)} may be given")
    if not given:
        return None
    name = given[0]
    value = body[name]
    if name == "response_format":
        return _response_format(value, sampling)
    if name == "guided_json":
        sampling.json_schema = _schema_text(value, name)
    elif name in ("guided_regex", "guided_grammar"):
        if not isinstance(value, str) or not value.strip():
            raise bad_request(name, f"{name}: must be a non-empty string")
        if name == "guided_regex":
            sampling.regex = value
        else:
            sampling.grammar = value
    else:
        sampling.choice.values.extend(_choices(value, name))
    return name


def _response_format(fmt: dict[str, Any], sampling: common_pb2.SamplingParams) -> str:
    kind = fmt.get("type")
    if kind == "json_object":
        sampling.json_object = True
        return "response_format"
    if kind != "json_schema":
        raise unsupported("response_format.type", "must be one of text, json_object, json_schema")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema", "response_format.json_schema: must be an object")
    schema = spec.get("schema")
    if schema is None:
        raise bad_request(
            "response_format.json_schema.schema",
            "response_format.json_schema.schema: required, a JSON Schema",
        )
    sampling.json_schema = _schema_text(schema, "response_format.json_schema.schema")
    return "response_format.json_schema.schema"


def _schema_text(schema: Any, where: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise bad_request(where, f"{where}: nested too deep to read") from None
        except ValueError as exc:  # not JSON, or an integer past Python's 4,300-digit limit
            raise bad_request(where, f"{where}: not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise bad_request(where, f"{where}: must be a JSON Schema object")
    return json.dumps(schema, ensure_ascii=False)


def _choices(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request(where, f"{where}: must be a non-empty list of non-empty strings")
    if len(value) > MAX_CHOICES:
        raise bad_request(where, f"{where}: at most {MAX_CHOICES} choices, got {len(value)}")
    return list(value)


def _logprobs(body: Mapping[str, Any], sampling: common_pb2.SamplingParams, chat: bool) -> None:
    value = body.get("logprobs")
    top = body.get("top_logprobs")
    if chat:
        # Chat: logprobs is a switch, top_logprobs the count (which needs the switch, as OpenAI says).
        if value is not None and not isinstance(value, bool):
            raise bad_request("logprobs", "logprobs: must be true or false")
        count = _count(top, "top_logprobs")
        if count and not value:
            raise bad_request("top_logprobs", "top_logprobs: needs logprobs: true")
        sampling.logprobs = bool(value)
        sampling.top_logprobs = count
        return
    # Legacy completions: logprobs is the count of alternatives (0 = only the chosen token's).
    if top is not None:
        raise bad_request("top_logprobs", "top_logprobs: completions take the count in logprobs")
    if value is None:
        return
    sampling.logprobs = True
    sampling.top_logprobs = _count(value, "logprobs")


def _count(value: Any, where: str) -> int:
    if value is None:
        return 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(where, f"{where}: must be an integer in 0..{MAX_TOP_LOGPROBS}")
    return value


def chat_logprobs(tokens: Sequence[common_pb2.TokenLogprobs]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``{"content": [...]}`` in OpenAI's shape."""
    return {
        "content": [
            _entry(
                t.text, t.token_bytes, t.logprob, [_entry(a.text, a.token_bytes, a.logprob) for a in t.top]
            )
            for t in tokens
        ]
    }


def legacy_token(text: str, raw: bytes) -> str:
    """A token as the legacy completions name it (``tokens``, and the keys of ``top_logprobs``):
    its bytes decoded (its text, for a byte-level vocabulary such as SmolLM2's; a SentencePiece
    token keeps the leading space its text drops); a token whose bytes are no whole UTF-8
    characters (a piece of a character split across tokens) by its bytes in OpenAI's spelling,
    ``bytes:\\xe6\\xb0``, since every such piece's text is the same U+FFFD and the dict of
    alternatives merged them. Without bytes (a replica older than ``token_bytes``, the synthetic
    one) its text, as before."""
    if not raw:
        return text
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def text_logprobs(tokens: Sequence[common_pb2.TokenLogprobs], offset: int = 0) -> dict[str, Any]:
    """A legacy completion's ``logprobs``: parallel lists, alternatives as {token: logprob}. Each
    token's alternatives include the token itself, as OpenAI's and vLLM's do (up to logprobs + 1
    entries; ``logprobs: 0`` gives just it), where clients read the chosen token's entry (keyed as
    its ``tokens`` entry is: ``legacy_token``). Two alternatives that still share a key (tokens
    of the very same bytes) keep the likelier one's logprob."""
    offsets = []
    tops = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
        top: dict[str, float] = {}
        for a in t.top:
            top.setdefault(legacy_token(a.text, a.token_bytes), _finite(a.logprob))
        top.setdefault(legacy_token(t.text, t.token_bytes), _finite(t.logprob))
        tops.append(top)
    return {
        "tokens": [legacy_token(t.text, t.token_bytes) for t in tokens],
        "token_logprobs": [_finite(t.logprob) for t in tokens],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def echo_logprobs(
    prompt: Sequence[common_pb2.TokenLogprobs], answer: Sequence[common_pb2.TokenLogprobs]
) -> dict[str, Any]:
    """An echoed completion's ``logprobs``: the prompt's tokens, then the answer's, as OpenAI and
    vLLM give them; the first prompt token has nothing before it, so its logprob and alternatives
    are null."""
    body = text_logprobs([*prompt, *answer])
    if prompt:
        body["token_logprobs"][0] = None
        body["top_logprobs"][0] = None
    return body


def _entry(text: str, raw: bytes, logprob: float, top: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    # ``bytes`` are the token's own (``token_bytes``): a piece of a character split across tokens
    # is its raw bytes, so joining an answer's tokens' bytes gives its UTF-8; its text's would be
    # U+FFFD's. A replica older than the field sends none: then the text's, as before.
    entry: dict[str, Any] = {"token": text, "logprob": _finite(logprob), "bytes": list(raw or text.encode())}
    if top is not None:
        entry["top_logprobs"] = top
    return entry


def _finite(logprob: float) -> float:
    # JSON has no -inf: OpenAI reports an impossible token at -9999.0.
    return logprob if math.isfinite(logprob) else -9999.0


@dataclass(frozen=True)
class ToolMode:
    """The answer is one function call. ``name`` set: a named ``tool_choice``, the answer is that
    function's arguments; None (``required``): the answer is ``{"name": …, "arguments": …}``."""

    name: str | None
    #: The request field a replica's refusal of the constraint names: the named function's
    #: ``parameters``, or ``tools`` when the constraint joins every function's.
    source: str = "tools"

    def call(self, text: str, call_id: str) -> dict[str, Any] | None:
        """The ``tool_calls`` entry for an answer's text; None when it is not a whole call (cut
        short by ``max_tokens``, a stop string or a stop token: the grammar did not complete).

        The arguments are the model's own JSON text, never parsed and written again: that
        turned ``1e400`` into ``Infinity``, which no strict JSON reader takes.
        """
        if self.name is not None:
            members = _object_members(text)
            return None if members is None else _tool_call(call_id, self.name, text)
        members = _object_members(text)
        if members is None or "name" not in members:
            return None
        name = _loads(members["name"])
        arguments = members.get("arguments", "{}")
        if not isinstance(name, str) or not isinstance(_loads(arguments), dict):
            return None
        return _tool_call(call_id, name, arguments)


_DECODER = json.JSONDecoder()
_NOT_JSON = object()


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _object_members(text: str) -> dict[str, str] | None:
    """A JSON object's members as their raw value texts, or None when ``text`` is not one whole
    JSON object: not JSON (cut short), or JSON Python's reader refuses (an integer of thousands
    of digits, which a schema's "integer" allows and max_tokens may leave room for)."""
    try:
        parsed = json.loads(text)
        if not isinstance(parsed, dict):
            return None
        members: dict[str, str] = {}
        at = _skip(text, text.index("{") + 1)
        while text[at] != "}":
            key, at = _DECODER.raw_decode(text, at)
            at = _skip(text, _skip(text, at) + 1)  # past the ':'
            start = at
            _, at = _DECODER.raw_decode(text, at)
            members[key] = text[start:at]
            at = _skip(text, at)
            if text[at] == ",":
                at = _skip(text, at + 1)
        return members
    except (ValueError, RecursionError, IndexError):
        return None


def _skip(text: str, at: int) -> int:
    while text[at] in " \t\n\r":
        at += 1
    return at


def _tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


_NO_AUTO = (
    "only 'required' or a named function: this model's chat template defines no tool calls, "
    "so the model cannot choose between answering and calling ('auto')"
)


def tool_mode(body: Mapping[str, Any], sampling: common_pb2.SamplingParams) -> ToolMode | None:
    """``tools`` with ``tool_choice`` as a constraint on ``sampling``: the call's arguments are
    constrained to the function's ``parameters`` schema. None when the answer is text."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice", "tool_choice: needs tools")
        return None
    functions = _functions(tools)
    if choice == "none":
        return None  # the tools are offered, and not to be called
    if choice is None or choice == "auto":
        raise unsupported("tool_choice", _NO_AUTO)
    if sampling.WhichOneof("constraint") is not None:
        raise bad_request("tool_choice", "tool_choice: cannot be combined with response_format or guided_*")
    if choice == "required":
        schema: dict[str, Any] = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": _own_root(parameters, index)},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for name, (index, parameters) in functions.items()
            ]
        }
        sampling.json_schema = json.dumps(schema, ensure_ascii=False)
        return ToolMode(None)
    named = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(named, dict) or not isinstance(named.get("name"), str):
        raise bad_request(
            "tool_choice", "tool_choice: 'none', 'required' or {'type': 'function', 'function': {'name': …}}"
        )
    if named["name"] not in functions:
        raise bad_request(
            "tool_choice.function.name", f"tool_choice.function.name: no tool {named['name']!r}"
        )
    index, parameters = functions[named["name"]]
    sampling.json_schema = json.dumps(parameters, ensure_ascii=False)
    return ToolMode(named["name"], f"tools[{index}].function.parameters")


def _own_root(parameters: dict[str, Any], index: int) -> dict[str, Any]:
    """A function's ``parameters`` nested in the joined ``required`` schema, with a base URI of its
    own: a pydantic model's ``#/$defs/…`` references resolve against the schema they sit in,
    which nested under ``anyOf[i].properties.arguments`` was the joined one (a 400: "Pointer
    '/$defs/Unit' does not exist", for every tool made from a model with a nested model)."""
    if "$id" in parameters:
        return parameters
    return {**parameters, "$id": f"urn:llm-mesh:tool:{index}"}


def _object_schema(parameters: dict[str, Any], where: str) -> dict[str, Any]:
    """``parameters`` as the schema of a JSON object: a function's arguments are one (OpenAI's
    rule). Without a ``type`` it is made one (``{}`` took any JSON value, so the forced call came
    back as text, never a call); another type is refused naming the field."""
    kind = parameters.get("type")
    if kind is None:
        return {**parameters, "type": "object"}
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return parameters if kind == "object" else {**parameters, "type": "object"}
    raise bad_request(
        f"{where}.function.parameters",
        f"{where}.function.parameters: must describe a JSON object (a function's arguments), not {kind!r}",
    )


def _functions(tools: Any) -> dict[str, tuple[int, dict[str, Any]]]:
    """Each function's name → its index in ``tools`` and its ``parameters`` schema."""
    if not isinstance(tools, list):
        raise bad_request("tools", "tools: must be a list")
    functions: dict[str, tuple[int, dict[str, Any]]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise bad_request(where, f"{where}: must be {{'type': 'function', 'function': {{'name': …}}}}")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise bad_request(
                f"{where}.function.parameters", f"{where}.function.parameters: must be a JSON Schema"
            )
        if function["name"] in functions:
            # Which of the two a call means would be a guess: a call names only the function.
            raise bad_request(
                f"{where}.function.name",
                f"{where}.function.name: {function['name'][:64]!r} names an earlier tool too",
            )
        functions[function["name"]] = (i, _object_schema(parameters, where))
    return functions
