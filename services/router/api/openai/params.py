"""OpenAI request bodies → the router's own ChatRequests, refusing clearly what cannot be honoured.

Every problem raises ``ApiError`` (400) naming the offending field in ``param``,
before any turn starts. A field that would change the answer and is not supported
is refused; ``null`` means "default" everywhere, as OpenAI's own API treats it.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.sampling_limits import (
    MAX_ABS_ADDITIVE_PENALTY,
    MAX_ABS_LOGIT_BIAS,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
)
from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.api.openai.body import finite_number
from services.router.api.openai.errors import ConstraintParam, bad_request, clipped, unsupported, utf8_text
from services.router.api.openai.extras import FIELDS as EXTRA_FIELDS
from services.router.api.openai.extras import Extras, extras
from services.router.api.openai.structured import ToolMode, apply_output_options, tool_mode
from services.router.api.openai.tool_history import (
    MAX_CALL_ID_CHARS,
    TOOL_ROLE,
    CallLedger,
    call_text,
    chat_calls,
    string_field,
)

log = logging.getLogger("llmmesh.router.openai")

MAX_CHOICES = 8
MAX_STOP_STRINGS = 16
SEED_LIMIT = 2**64
INT32_MAX = 2**31 - 1
# Legacy completions default to 16 tokens (OpenAI's documented default); chat leaves it to the engine.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# "developer" is OpenAI's newer name for the system role.
ROLE_NAMES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# Accepted and ignored: they change nothing in the answer (bookkeeping, vLLM load-tool extras).
_HARMLESS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prompt_cache_key",
        "safety_identifier",
        "stream_options",
        "ignore_eos",
        "spaces_between_special_tokens",
    }
)
_CHAT_KNOWN = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "stop_token_ids",
        "include_stop_str_in_output",
        "allowed_token_ids",
        "bad_words",
        "stream",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "response_format",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
        "reasoning_effort",
        "verbosity",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "best_of",
        "use_beam_search",
    }
    | EXTRA_FIELDS
)
_COMPLETIONS_KNOWN = _CHAT_KNOWN - {"messages", "max_completion_tokens"} | {"prompt", "echo", "suffix"}
# Unknown fields are ignored (clients send new ones all the time) but said once each, not per request;
# the names remembered are bounded, so a client inventing names cannot grow the set.
_logged_unknown: set[str] = set()
MAX_LOGGED_UNKNOWN = 64


@dataclass(frozen=True)
class Generation:
    """One HTTP request as turns: ``turns[i]`` makes choice ``i``."""

    model: str
    turns: tuple[router_pb2.ChatRequest, ...]
    stream: bool
    include_usage: bool
    #: n: the choices of each prompt, consecutive in ``turns``.
    per_prompt: int = 1
    #: ``stream_options.continuous_usage_stats`` (vLLM's) with ``include_usage``: every chunk
    #: carries the request's usage so far, not ``null``.
    continuous_usage: bool = False
    #: llm-mesh's own fields (session, RAG, cache policy, resumable), already applied to ``turns``.
    extras: Extras = field(default_factory=Extras)
    #: Chat with tools: every answer is a call (its arguments constrained to the tool's schema).
    tool: ToolMode | None = None
    #: The request field its output constraint came from, for a replica's refusal to name it.
    constraint: ConstraintParam | None = None
    #: Completions with ``echo``: each choice's prompt text (None: given as token ids, whose
    #: texts come back with them); empty without echo.
    echo: tuple[str | None, ...] = ()
    #: Echo with ``max_tokens`` 0: the prompt is scored and no answer is shown.
    score_only: bool = False
    #: The request's name for the answer's token limit (``max_completion_tokens``,
    #: ``max_output_tokens``), for a replica's refusal, which names ``max_tokens``, to name it.
    max_tokens_field: str = "max_tokens"


def constraint_param(sampling: common_pb2.SamplingParams, source: str | None) -> ConstraintParam | None:
    engine = sampling.WhichOneof("constraint")
    return ConstraintParam(engine, source) if engine is not None and source is not None else None


def chat_generation(body: Any, request_id: str) -> Generation:
    """A ``POST /v1/chat/completions`` body as turns."""
    body = json_object(body)
    # Chat maps tools itself (structured.tool_mode); completions have none to map.
    refuse_unsupported({k: v for k, v in body.items() if k not in ("tools", "tool_choice")}, _CHAT_KNOWN)
    messages = _messages(body.get("messages"), continues_history=body.get("session_id") is not None)
    max_tokens_field = "max_completion_tokens"
    max_tokens = int_field(body, max_tokens_field, 1, INT32_MAX)
    if max_tokens is None:
        max_tokens_field = "max_tokens"
        max_tokens = int_field(body, max_tokens_field, 1, INT32_MAX)
    sampling = sampling_params(body, max_tokens)
    source = apply_output_options(body, sampling, chat=True)
    tool = tool_mode(body, sampling)
    if tool is not None:
        source = tool.source  # the constraint is the called function's parameters schema
    return dataclasses.replace(
        turns_generation(body, request_id, [messages], sampling),
        tool=tool,
        constraint=constraint_param(sampling, source),
        max_tokens_field=max_tokens_field,
    )


def completion_generation(body: Any, request_id: str) -> Generation:
    """A ``POST /v1/completions`` body as turns: one per prompt and choice, prompt-major as OpenAI orders them."""
    body = json_object(body)
    # Completions serve echo themselves (chat takes vLLM's echo at its default only).
    refuse_unsupported({k: v for k, v in body.items() if k != "echo"}, _COMPLETIONS_KNOWN)
    echo = _bool(body, "echo")
    if body.get("suffix") not in (None, ""):
        raise unsupported("suffix", "insertion (suffix) is not supported")
    prompts = _completion_prompts(body.get("prompt"))
    if len(prompts) > MAX_CHOICES:
        raise bad_request("prompt", f"prompt: at most {MAX_CHOICES} prompts per request")
    if not all(p.text or p.token_ids for p in prompts):
        raise bad_request("prompt", "prompt: must not be empty")
    # With echo, max_tokens 0 scores the prompt alone (HELM's and OpenAI's old scoring requests).
    max_tokens = int_field(body, "max_tokens", 0 if echo else 1, INT32_MAX)
    score_only = max_tokens == 0
    if score_only:
        max_tokens = 1  # the replica always draws a token; the front shows none
    sampling = sampling_params(body, COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
    source = apply_output_options(body, sampling, chat=False)
    if echo:
        # The prompt comes back as tokens, scored when logprobs are asked for (lm-evaluation-
        # harness's loglikelihood requests: echo, logprobs, max_tokens 1).
        sampling.prompt_logprobs = sampling.top_logprobs
    # Raw, as OpenAI and vLLM serve /v1/completions: the text is continued, no chat template around it.
    generation = turns_generation(body, request_id, prompts, sampling)
    return dataclasses.replace(
        generation,
        constraint=constraint_param(sampling, source),
        echo=tuple(t.prompt or None for t in generation.turns) if echo else (),
        score_only=score_only,
    )


@dataclass(frozen=True)
class Prompt:
    """One raw prompt of a ``/v1/completions`` body (a chat body has message lists instead): its
    text, or the token ids it was given as."""

    text: str = ""
    token_ids: tuple[int, ...] = ()


_PROMPT_SHAPES = (
    "prompt: required, a string, a list of strings, a list of token ids or a list of token-id lists"
)


def _completion_prompts(prompt: Any) -> list[Prompt]:
    """``prompt`` as OpenAI takes it: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [Prompt(prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt", _PROMPT_SHAPES)
    if all(isinstance(p, str) for p in prompt):
        return [Prompt(p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [Prompt(token_ids=_token_ids(p, f"prompt[{i}]")) for i, p in enumerate(prompt)]
    if any(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("prompt", _PROMPT_SHAPES)
    return [Prompt(token_ids=_token_ids(prompt, "prompt"))]  # one prompt's ids: each one checked


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no token


def _token_ids(ids: list[Any], where: str, param: str = "prompt") -> tuple[int, ...]:
    """Token ids as the replica takes them (int32, >= 0); whether each is in the model's
    vocabulary is the replica's to say, naming the field too."""
    for j, t in enumerate(ids):
        if not _is_int(t) or not 0 <= t <= INT32_MAX:
            raise bad_request(param, f"{where}[{j}]: token ids must be integers in [0, {INT32_MAX}]")
    return tuple(ids)


def _bad_words(value: Any) -> list[str]:
    """vLLM's ``bad_words``: a list of non-blank strings; null = none."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(w, str) and w.strip() for w in value):
        raise bad_request("bad_words", "bad_words: must be a list of words (non-blank strings)")
    if len(value) > MAX_BAD_WORDS:
        raise bad_request("bad_words", f"bad_words: at most {MAX_BAD_WORDS} words, got {len(value)}")
    if any(len(w) > MAX_STOP_CHARS for w in value):
        raise bad_request("bad_words", f"bad_words: a word may be at most {MAX_STOP_CHARS} characters")
    return [utf8_text(w, "bad_words") for w in value]


def _token_id_list(body: Mapping[str, Any], name: str, most: int) -> tuple[int, ...]:
    """``body[name]`` as at most ``most`` token ids; null = none."""
    ids = body.get(name)
    if ids is None:
        return ()
    if not isinstance(ids, list):
        raise bad_request(name, f"{name}: must be a list of token ids")
    if len(ids) > most:
        raise bad_request(name, f"{name}: at most {most} ids, got {len(ids)}")
    return _token_ids(ids, name, name)


def turns_generation(
    body: Mapping[str, Any],
    request_id: str,
    conversations: Sequence[list[common_pb2.ChatMessage] | Prompt],
    sampling: common_pb2.SamplingParams,
) -> Generation:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model", "model: must be a string")
    if model is not None:
        model = utf8_text(model, "model")
    n = int_field(body, "n", 1, MAX_CHOICES) or 1
    if len(conversations) * n > MAX_CHOICES:
        raise bad_request("n", f"n: prompts × n must be at most {MAX_CHOICES}")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options", "stream_options: must be an object")
    for option in ("include_usage", "continuous_usage_stats"):
        if options and options.get(option) is not None and not isinstance(options[option], bool):
            raise bad_request(f"stream_options.{option}", f"stream_options.{option}: must be true or false")
    include_usage = bool(options and options.get("include_usage"))
    # vLLM's rule: continuous_usage_stats alone changes nothing; it needs include_usage.
    continuous_usage = include_usage and bool(options and options.get("continuous_usage_stats"))
    wanted = extras(body, len(conversations) * n)
    turns: list[router_pb2.ChatRequest] = []
    for conversation in conversations:
        for _ in range(n):
            index = len(turns)
            params = common_pb2.SamplingParams()
            params.CopyFrom(sampling)
            if sampling.HasField("seed") and index:
                # Choices of one seeded request differ from each other, and each is reproducible.
                params.seed = (sampling.seed + index) % SEED_LIMIT
            turn = router_pb2.ChatRequest(
                messages=() if isinstance(conversation, Prompt) else conversation,
                prompt=conversation.text if isinstance(conversation, Prompt) else "",
                prompt_token_ids=conversation.token_ids if isinstance(conversation, Prompt) else (),
                model=model or "",
                sampling=params,
                request_id=turn_request_id(request_id, index, len(conversations) * n),
            )
            wanted.apply(turn)
            turns.append(turn)
    return Generation(
        model or "", tuple(turns), stream, include_usage, n, continuous_usage=continuous_usage, extras=wanted
    )


def turn_request_id(request_id: str, index: int, choices: int) -> str:
    """Choice ``index``'s turn id: the request's own when it is the only one (what gRPC Resume takes)."""
    return f"{request_id}-{index}" if choices > 1 else request_id


def _as_float32(value: float) -> float:
    """``value`` as a proto ``float`` field stores it."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def sampling_params(body: Mapping[str, Any], max_tokens: int | None) -> common_pb2.SamplingParams:
    """``max_tokens`` None (chat, responses): the answer may take all the context leaves, as
    OpenAI's and vLLM's do; the engine's own default (256) cut SDK and LangChain answers,
    which send no limit, at 256 tokens."""
    sampling = common_pb2.SamplingParams()
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    else:
        sampling.max_tokens_to_context = True
    if (temperature := _number(body, "temperature", 0.0, 2.0)) is not None:
        sampling.temperature = temperature
    if (top_p := _number(body, "top_p", 0.0, 1.0)) is not None:
        # Compared as the float32 the field holds: 1e-46 passed a float64 check, rounded to 0.0
        # on the wire, and the replica refused "top_p: must be in (0, 1], got 0.0", a value the
        # client never sent. Below float32's range it is 0, as OpenAI's [0, 1] allows.
        if _as_float32(top_p) > 0:
            sampling.top_p = top_p
        else:
            # OpenAI takes 0 (its range is [0, 1]): the nucleus shrinks to the likeliest token.
            sampling.top_k = 1
    if min_p := _number(body, "min_p", 0.0, 1.0):
        sampling.min_p = min_p  # vLLM's extra; 0 means off there as here
    if (top_k := int_field(body, "top_k", -1, INT32_MAX)) is not None and top_k > 0:
        sampling.top_k = min(top_k, sampling.top_k or top_k)  # vLLM's extra; -1 and 0 mean off there as here
    # OpenAI's seed is a signed 64-bit integer (apps send -1 for "any"): a negative one is its
    # two's-complement bits, a seed of its own like any other.
    if (seed := int_field(body, "seed", -(2**63), SEED_LIMIT - 1)) is not None:
        sampling.seed = seed % SEED_LIMIT
    if (penalty := _number(body, "repetition_penalty", 0.01, 100.0)) is not None:
        sampling.repetition_penalty = penalty
    if presence := _number(body, "presence_penalty", -MAX_ABS_ADDITIVE_PENALTY, MAX_ABS_ADDITIVE_PENALTY):
        sampling.presence_penalty = presence
    if frequency := _number(body, "frequency_penalty", -MAX_ABS_ADDITIVE_PENALTY, MAX_ABS_ADDITIVE_PENALTY):
        sampling.frequency_penalty = frequency
    sampling.logit_bias.update(_logit_bias(body.get("logit_bias")))
    if min_tokens := int_field(body, "min_tokens", 0, INT32_MAX):
        if max_tokens is not None and min_tokens > max_tokens:
            raise bad_request(
                "min_tokens",
                f"min_tokens: must be at most the answer's token limit ({max_tokens}), got {min_tokens}",
            )
        sampling.min_tokens = min_tokens
    # vLLM's extras: lists of token ids.
    sampling.stop_token_ids.extend(_token_id_list(body, "stop_token_ids", MAX_STOP_TOKEN_IDS))
    sampling.allowed_token_ids.extend(_token_id_list(body, "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS))
    sampling.bad_words.extend(_bad_words(body.get("bad_words")))
    sampling.ignore_eos = _bool(body, "ignore_eos")
    sampling.include_stop_str_in_output = _bool(body, "include_stop_str_in_output")
    sampling.stop.extend(_stop(body.get("stop")))
    return sampling


_WHY_NOT = {
    "tools": "tool calls are not supported: this model's chat template defines none; "
    "use response_format json_schema with the function's parameters",
    "tool_choice": "tool calls are not supported: this model's chat template defines none "
    "(so tool_choice 'auto' cannot be honoured)",
    # As the Responses API's `reasoning` and `text.verbosity` (responses.py), and as OpenAI answers
    # them for a model that does not reason: the same LangChain client passed on chat and was a
    # 400 on /v1/responses.
    "reasoning_effort": "this model does not reason before it answers; send null or 'none'",
    "verbosity": "only 'medium': the answer's length is max_tokens'",
}


def refuse_unsupported(body: Mapping[str, Any], known: frozenset[str]) -> None:
    """Fields that would change the answer get a 400 unless null or their neutral value."""
    neutral: dict[str, tuple[Any, ...]] = {
        "tools": ([],),
        "functions": ([],),
        "tool_choice": ("none",),
        "function_call": ("none",),
        "audio": (),
        "prediction": (),
        "web_search_options": ({},),
        "use_beam_search": (False,),
        "reasoning_effort": ("none",),
        "verbosity": ("medium",),
        # vLLM's extras that change the prompt or the answer: accepted at their defaults only.
        "echo": (False,),
        "add_generation_prompt": (True,),
        "continue_final_message": (False,),
        "skip_special_tokens": (True,),
        "length_penalty": (1, 1.0),
        "truncate_prompt_tokens": (),
        "prompt_logprobs": (),
        "chat_template": (),
        "chat_template_kwargs": ({},),
        "documents": (),
        "logits_processors": (),
        "structured_outputs": (),
        "return_tokens_as_token_ids": (False,),
        "guided_whitespace_pattern": (),
    }
    for name, allowed in neutral.items():
        value = body.get(name)
        if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
            raise unsupported(name, _WHY_NOT.get(name, "not supported by this server"))
    if (modalities := body.get("modalities")) is not None and modalities != ["text"]:
        raise unsupported("modalities", "only ['text'] is supported")
    if body.get("best_of") not in (None, 1) and body.get("best_of") != body.get("n"):
        raise unsupported("best_of", "only best_of = n is supported")
    for name in body:
        if name in known or name in _HARMLESS or name in _logged_unknown:
            continue
        if len(_logged_unknown) < MAX_LOGGED_UNKNOWN:
            _logged_unknown.add(name)
            log.info("ignoring unknown request field %r (logged once)", clipped(name, 200))


def _messages(raw: Any, continues_history: bool = False) -> list[common_pb2.ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages", "messages: required, a non-empty list of messages")
    out = []
    ledger = CallLedger(continues_history=continues_history)
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(where, f"{where}: must be an object")
        role = message.get("role")
        if role == "function" or message.get("function_call"):
            # The deprecated functions API: its calls carry no id for a result to answer.
            field = f"{where}.role" if role == "function" else f"{where}.function_call"
            raise unsupported(
                field, "the deprecated functions API is not supported: use tool_calls and role 'tool'"
            )
        if role == TOOL_ROLE:
            call_id = string_field(message, "tool_call_id", where, MAX_CALL_ID_CHARS)
            ledger.check_result(call_id, f"{where}.tool_call_id")
            out.append(
                common_pb2.ChatMessage(role=TOOL_ROLE, content=message_text(message.get("content"), where))
            )
            continue
        if not isinstance(role, str) or role not in ROLE_NAMES:
            raise bad_request(
                f"{where}.role", f"{where}.role: must be one of system, developer, user, assistant, tool"
            )
        content = message.get("content")
        calls = message.get("tool_calls")
        if calls is not None and role != "assistant":
            raise bad_request(f"{where}.tool_calls", f"{where}.tool_calls: only an assistant makes calls")
        if content is None and role == "assistant":
            content = ""  # OpenAI's schema lets an assistant's content be null (or absent), as vLLM reads it
        text = message_text(content, where)
        if calls:
            made = chat_calls(calls, f"{where}.tool_calls")
            for call in made:
                ledger.made(call)
            # What the assistant said before calling, then its calls, as the model reads them.
            text = "\n".join(t for t in (text, utf8_text(call_text(made), f"{where}.tool_calls")) if t)
        out.append(common_pb2.ChatMessage(role=ROLE_NAMES[role], content=text))
    return out


#: Chat's content parts that carry text (the Responses API names its own: responses.py).
CHAT_TEXT_PARTS = frozenset({"text"})


def message_text(raw: Any, where: str, text_parts: frozenset[str] = CHAT_TEXT_PARTS) -> str:
    """A message's text: a string, or a list of text parts (of ``text_parts``' types) joined
    with newlines, as OpenAI's own models read them."""
    if isinstance(raw, str):
        return utf8_text(raw, f"{where}.content")
    if isinstance(raw, list):
        texts = []
        for j, part in enumerate(raw):
            at = f"{where}.content[{j}]"
            if not isinstance(part, dict):
                raise bad_request(at, f"{at}: must be an object")
            if part.get("type") not in text_parts:
                raise unsupported(
                    f"{at}.type", f"only text parts ({', '.join(sorted(text_parts))}) are supported"
                )
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{at}.text", f"{at}.text: must be a string")
            texts.append(utf8_text(part["text"], f"{at}.text"))
        return "\n".join(texts)
    raise bad_request(f"{where}.content", f"{where}.content: must be a string or a list of text parts")


def _stop(raw: Any) -> list[str]:
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop", "stop: must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request("stop", f"stop: at most {MAX_STOP_STRINGS} strings")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request("stop", f"stop: a stop string may be at most {MAX_STOP_CHARS} characters")
    # An empty stop string would end every answer at once.
    return [utf8_text(s, f"stop[{i}]") for i, s in enumerate(stops) if s]


def json_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object", "invalid_request_body")
    return body


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(name, f"{name}: must be true or false")
    return value


def int_field(body: Mapping[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    # JSON has one number type: 2.0 is an integer to most clients, 2.5 is not; true is never one.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(name, f"{name}: must be an integer")
    if value < lo or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise bad_request(name, f"{name}: must be {bounds}, got {value}")
    return value


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (JSON object keys, so strings) to a bias in [-100, 100]."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise bad_request("logit_bias", "logit_bias: must be an object of token ids to numbers")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request("logit_bias", f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    bias: dict[int, float] = {}
    for key, raw in value.items():
        token = str(key).strip()
        # A decimal token id, as OpenAI takes it ("50256"); int() would also take "1_0" and "+3",
        # and raises on more than 4,300 digits (so the length is checked before it runs).
        if not (token.isascii() and token.isdigit() and len(token) <= 10) or int(token) > INT32_MAX:
            raise bad_request(
                "logit_bias",
                f"logit_bias: keys must be token ids (decimal integers), got {clipped(str(key), 64)!r}",
            )
        if (number := finite_number(raw)) is None:
            raise bad_request("logit_bias", f"logit_bias: the value for token {token} must be a number")
        if not -MAX_ABS_LOGIT_BIAS <= number <= MAX_ABS_LOGIT_BIAS:
            raise bad_request(
                "logit_bias",
                f"logit_bias: values must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], "
                f"got {number} for token {token}",
            )
        bias[int(token)] = number
    return bias


def _number(body: Mapping[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if (number := finite_number(value)) is None:
        raise bad_request(name, f"{name}: must be a number")
    if not lo <= number <= hi:
        raise bad_request(name, f"{name}: must be in [{lo}, {hi}], got {number:g}")
    return number
