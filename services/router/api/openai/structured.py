"""OpenAI's structured-output and logprobs fields → the engine's constraint and logprobs.

``response_format`` (``text``, ``json_object``, ``json_schema``), vLLM's ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` extras, and ``logprobs`` /
``top_logprobs`` map onto ``SamplingParams``; whether a schema, regex or grammar
compiles is the replica's answer (INVALID_ARGUMENT, a 400 naming the field). Tools are
refused with a 400 that says what is missing: this model's chat template defines no
tool calls, so ``tool_choice: "auto"`` cannot be honoured.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

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


def apply_output_options(body: Mapping[str, Any], sampling: common_pb2.SamplingParams, chat: bool) -> None:
    """Set ``sampling``'s constraint and logprobs from ``body``; a 400 naming the field otherwise."""
    _constraint(body, sampling)
    _logprobs(body, sampling, chat)


def _constraint(body: Mapping[str, Any], sampling: common_pb2.SamplingParams) -> None:
    given = [name for name in sorted(FIELDS - {"logprobs", "top_logprobs"}) if body.get(name) is not None]
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") == "text"):
        if not isinstance(fmt, dict):
            raise bad_request("response_format", "response_format: must be an object")
        given.remove("response_format")  # plain text: no constraint
    if len(given) > 1:
        raise bad_request(given[1], f"{given[1]}: only one of {', '.join(given)} may be given")
    if not given:
        return
    name = given[0]
    value = body[name]
    if name == "response_format":
        _response_format(value, sampling)
    elif name == "guided_json":
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


def _response_format(fmt: dict[str, Any], sampling: common_pb2.SamplingParams) -> None:
    kind = fmt.get("type")
    if kind == "json_object":
        sampling.json_object = True
        return
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


def _schema_text(schema: Any, where: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise bad_request(where, f"{where}: not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise bad_request(where, f"{where}: must be a JSON Schema object")
    return json.dumps(schema, ensure_ascii=False)


def _choices(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request(where, f"{where}: must be a non-empty list of non-empty strings")
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
        "content": [_entry(t.text, t.logprob, [_entry(a.text, a.logprob) for a in t.top]) for t in tokens]
    }


def text_logprobs(tokens: Sequence[common_pb2.TokenLogprobs], offset: int = 0) -> dict[str, Any]:
    """A legacy completion's ``logprobs``: parallel lists, alternatives as {token: logprob}."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [_finite(t.logprob) for t in tokens],
        "top_logprobs": [{a.text: _finite(a.logprob) for a in t.top} for t in tokens],
        "text_offset": offsets,
    }


def _entry(text: str, logprob: float, top: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}
    if top is not None:
        entry["top_logprobs"] = top
    return entry


def _finite(logprob: float) -> float:
    # JSON has no -inf: OpenAI reports an impossible token at -9999.0.
    return logprob if math.isfinite(logprob) else -9999.0
