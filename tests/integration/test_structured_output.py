"""Structured output and logprobs on a real replica: every constrained answer validates, free
answers in the same batch keep their tokens, logprobs are transformers' own, bad constraints
are INVALID_ARGUMENT before any engine work, and a resumed request keeps its grammar."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from services.common.prompts import Message, prompt_token_ids
from services.common.sampling_limits import MAX_CHOICES
from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.inference.grammar import MAX_SCHEMA_PATTERN_PROPERTIES, MAX_SCHEMA_PROPERTIES
from tests.support.device import reference_model
from tests.support.inference import Generation, generate
from tests.support.processes import ServiceProcess

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 96


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "maxLength": 12}
#: Twenty schemas: nested objects, arrays, enums, bounded numbers, patterned strings, optional keys.
#: Every one can be finished well within MAX_TOKENS (an unbounded integer, or a number without
#: multipleOf, lets a small greedy model write digits until max_tokens, which the engine rightly
#: ends with LENGTH: tested apart below).
SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"city": NAME, "country": {"enum": ["France", "Japan", "Peru"]}}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    _obj(
        {
            "point": _obj(
                {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 99},
                }
            )
        }
    ),
    _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    _obj(
        {
            "color": {"enum": ["red", "green", "blue"]},
            "shade": {"type": "integer", "minimum": 1, "maximum": 5},
        }
    ),
    _obj({"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}, ["title"]),
    _obj(
        {
            "user": _obj(
                {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                }
            )
        }
    ),
    _obj(
        {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "maxItems": 4,
            }
        }
    ),
    _obj({"price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.25}}),
    _obj({"status": {"enum": ["open", "closed"]}, "note": NAME}, ["status"]),
    _obj({"a": _obj({"b": _obj({"c": {"type": "integer", "minimum": 0, "maximum": 9}})})}),
    _obj(
        {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": _obj(
                    {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    }
                ),
            }
        }
    ),
    _obj({"answer": {"enum": ["yes", "no", "maybe"]}}),
    _obj({"first": NAME, "last": NAME, "middle": NAME}, ["first", "last"]),
    _obj({"code": {"type": "string", "pattern": "^[A-F0-9]{4}$"}, "valid": {"type": "boolean"}}),
    _obj({"temp": {"type": "integer", "minimum": -50, "maximum": 50}, "unit": {"enum": ["C", "F"]}}),
    _obj(
        {
            "pair": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 2,
            }
        }
    ),
    _obj({"lang": {"enum": ["en", "fr", "ja"]}, "words": {"type": "integer", "minimum": 0, "maximum": 999}}),
]
PROMPTS = [
    "Describe a person as JSON.",
    "Give me some data about a place, in JSON.",
    "Answer in JSON: is the sky blue?",
    "Write a short JSON record about a book.",
    "Output a JSON object about the weather.",
]
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(cat|dog)s? [a-z]{1,6}"]
CHOICES = [("yes", "no"), ("red", "green", "blue")]
FREE_PROMPTS = ["What is the capital of France?", "Count to five.", "Say hello."]


@pytest.fixture(scope="module")
def replica(shared_replica: ServiceProcess) -> ServiceProcess:
    """The session's shared real replica: fp32 on the test device, 64 seats (the engine's default)."""
    return shared_replica


@pytest.fixture()
async def stub(replica: ServiceProcess) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    async with grpc.aio.insecure_channel(replica.address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_path))


def start(prompt: str, **sampling: Any) -> inference_pb2.GenerateStart:
    sampling.setdefault("max_tokens", MAX_TOKENS)
    return inference_pb2.GenerateStart(
        messages=[common_pb2.ChatMessage(role="user", content=prompt)],
        sampling=common_pb2.SamplingParams(temperature=0.0, **sampling),
    )


async def run_batch(stub: inference_pb2_grpc.InferenceStub, prompts_per_schema: int) -> None:
    """Every constraint kind and the free requests at once (one engine batch), then the free ones alone."""
    constrained: list[tuple[str, Any, inference_pb2.GenerateStart]] = []
    for i, schema in enumerate(SCHEMAS):
        for k in range(prompts_per_schema):
            prompt = PROMPTS[(i + k) % len(PROMPTS)]
            constrained.append(("json", schema, start(prompt, json_schema=json.dumps(schema))))
    for regex in REGEXES:
        constrained.append(("regex", regex, start("Write something short.", regex=regex)))
    for choice in CHOICES:
        values = common_pb2.Choices(values=choice)
        constrained.append(("choice", choice, start("Pick one.", choice=values)))
    free = [start(p, max_tokens=24) for p in FREE_PROMPTS]
    results = await asyncio.gather(
        *(generate(stub, s) for _, _, s in constrained), *(generate(stub, s) for s in free)
    )
    for (kind, spec, _), got in zip(constrained, results, strict=False):
        assert got.finish_reason == common_pb2.FINISH_REASON_STOP, (kind, spec, got.text)
        if kind == "json":
            jsonschema.validate(json.loads(got.text), spec)
        elif kind == "regex":
            assert re.fullmatch(spec, got.text), (spec, got.text)
        else:
            assert got.text in spec
    alone = [await generate(stub, s) for s in free]
    assert [g.token_ids for g in results[len(constrained) :]] == [g.token_ids for g in alone]


async def test_constrained_outputs_validate_and_free_neighbours_keep_their_tokens(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    await run_batch(stub, prompts_per_schema=1)


@pytest.mark.full
async def test_twenty_schemas_times_five_prompts_validate(stub: inference_pb2_grpc.InferenceStub) -> None:
    await run_batch(stub, prompts_per_schema=5)


async def test_a_grammar_not_finished_within_max_tokens_ends_with_length(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    digits = json.dumps({"type": "object", "properties": {"n": {"type": "string", "pattern": "^[0-9]{40}$"}}})
    got = await generate(stub, start(PROMPTS[0], json_schema=digits, max_tokens=8))
    assert got.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(got.token_ids) == 8
    with pytest.raises(json.JSONDecodeError):  # cut short: not claimed complete, and it is not
        json.loads(got.text)
    # Completed by the last token max_tokens allows: whole, so STOP, not LENGTH (the SDKs'
    # parse() refuses a "length" answer). "yes" is one token of SmolLM2's vocabulary.
    whole = await generate(stub, start("Pick one.", choice=common_pb2.Choices(values=["yes"]), max_tokens=1))
    assert (whole.text, len(whole.token_ids)) == ("yes", 1)
    assert whole.finish_reason == common_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize(
    ("grammar", "answers"),
    [
        ('start: "x ::= y"', {"x ::= y"}),  # Lark with "::=" in a literal: not taken for GBNF
        ('root ::= "yes" | "no"', {"yes", "no"}),  # GBNF
    ],
)
async def test_lark_and_gbnf_grammars_are_told_apart(
    stub: inference_pb2_grpc.InferenceStub, grammar: str, answers: set[str]
) -> None:
    got = await generate(stub, start("Answer.", grammar=grammar, max_tokens=16))
    assert got.text in answers and got.finish_reason == common_pb2.FINISH_REASON_STOP


async def test_logprobs_are_transformers_log_softmax_and_top_logprobs_its_top_k(
    stub: inference_pb2_grpc.InferenceStub, model_path: Path, tokenizer: Any
) -> None:
    got = await generate_with_logprobs(
        stub, start(FREE_PROMPTS[1], max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=5)
    )
    tokens, logprobs = got
    assert len(logprobs) == len(tokens) == 12
    model = reference_model(model_path)
    prompt = prompt_token_ids(tokenizer, [Message("user", FREE_PROMPTS[1])], "")
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens], device=model.device)).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).cpu()
    for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert abs(lp.logprob - float(expected[i, token])) < 1e-4, i
        values, ids = torch.topk(expected[i], 5)
        assert [a.token_id for a in lp.top] == ids.tolist(), i
        assert all(abs(a.logprob - v) < 1e-4 for a, v in zip(lp.top, values.tolist(), strict=True))
        assert [a.text for a in lp.top] == [tokenizer.decode([t]) for t in ids.tolist()]
        assert lp.text == tokenizer.decode([token])


async def generate_with_logprobs(
    stub: inference_pb2_grpc.InferenceStub, s: inference_pb2.GenerateStart
) -> tuple[list[int], list[common_pb2.TokenLogprobs]]:
    call = stub.Generate(timeout=120)
    await call.write(inference_pb2.GenerateRequest(start=s))
    tokens: list[int] = []
    logprobs: list[common_pb2.TokenLogprobs] = []
    async for response in call:
        if response.HasField("chunk"):
            assert len(response.chunk.logprobs) == len(response.chunk.token_ids)
            tokens.extend(response.chunk.token_ids)
            logprobs.extend(response.chunk.logprobs)
    return tokens, logprobs


def _pattern_properties(n: int) -> dict[str, Any]:
    """Half at the top, half in a nested object: the budget counts every level."""
    top = {f"^k{i}_[a-z]{{{i % 7}}}$": {"type": "string"} for i in range(n // 2)}
    inner = {f"^n{i}_[0-9]+$": {"type": "integer"} for i in range(n - n // 2)}
    return {"type": "object", "patternProperties": top, "properties": {"inner": {"patternProperties": inner}}}


def _nested_properties(n: int) -> dict[str, Any]:
    rows = {f"f{i}": {"type": "integer"} for i in range(n - 1)}
    return {"type": "object", "properties": {"row": {"type": "object", "properties": rows}}}


@pytest.mark.parametrize(
    ("field", "sampling"),
    [
        ("json_schema", {"json_schema": "{not json"}),
        ("json_schema", {"json_schema": '{"type": "bogus"}'}),
        ("json_schema", {"json_schema": "[1, 2]"}),
        ("regex", {"regex": "a(b"}),
        ("regex", {"regex": ""}),
        ("grammar", {"grammar": "start: undefined_rule"}),
        ("grammar", {"grammar": "root ::= (("}),
        ("choice", {"choice": common_pb2.Choices()}),
        ("choice", {"choice": common_pb2.Choices(values=["a", ""])}),
        # Compiles, but SmolLM2's vocabulary has no token for U+0016 or U+0004: it cannot begin.
        ("choice", {"choice": common_pb2.Choices(values=["\x16"])}),
        ("regex", {"regex": "\x04+"}),
        ("top_logprobs", {"top_logprobs": 21}),
        # Hostile sizes: deeper than Python's JSON reader recurses, more choices than compile fast.
        ("json_schema", {"json_schema": '{"type": "array", "items": ' * 2000 + "{}" + "}" * 2000}),
        ("json_schema", {"json_schema": '{"const": ' + "9" * 5000 + "}"}),
        ("choice", {"choice": common_pb2.Choices(values=[str(i) for i in range(MAX_CHOICES + 1)])}),
        # 15 KB of patternProperties compiled for 29 s (one more than the budget, here, would
        # take seconds); 5,001 properties is past OpenAI's own bound.
        ("json_schema", {"json_schema": json.dumps(_pattern_properties(MAX_SCHEMA_PATTERN_PROPERTIES + 1))}),
        ("json_schema", {"json_schema": json.dumps(_nested_properties(MAX_SCHEMA_PROPERTIES + 1))}),
    ],
)
async def test_bad_constraints_are_invalid_argument_naming_the_field_before_any_engine_work(
    stub: inference_pb2_grpc.InferenceStub, field: str, sampling: dict[str, Any]
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(stub, start("hi", **sampling))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith(field + ":"), caught.value.details()
    load = await stub.GetLoad(inference_pb2.GetLoadRequest())
    assert load.waiting == 0 and load.running == 0 and load.kv_blocks_used == 0


async def test_a_constraint_that_dead_ends_mid_output_ends_that_request_alone_saying_why(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    """The first character can be written, the U+0016 after it cannot: the request ends as
    INVALID_ARGUMENT naming the constraint (not INTERNAL: the engine did nothing wrong, and a
    router must not fail it over or count it against the replica); its batch neighbour is untouched."""
    free = start(FREE_PROMPTS[0], max_tokens=16)
    alone = await generate(stub, free)
    dead_end, beside = await asyncio.gather(
        generate(stub, start("Pick one.", choice=common_pb2.Choices(values=["a\x16"]))),
        generate(stub, free),
        return_exceptions=True,
    )
    assert isinstance(dead_end, grpc.aio.AioRpcError), dead_end
    assert dead_end.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (dead_end.details() or "").startswith("choice: the output constraint cannot go on")
    assert isinstance(beside, Generation)
    assert beside.token_ids == alone.token_ids
    load = await stub.GetLoad(inference_pb2.GetLoadRequest())
    assert load.running == 0 and load.kv_blocks_used == 0


async def test_a_resumed_request_continues_its_grammar_token_for_token(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    schema = json.dumps(SCHEMAS[0])
    whole = await generate(stub, start(PROMPTS[0], json_schema=schema))
    assert whole.finish_reason == common_pb2.FINISH_REASON_STOP
    cut = len(whole.token_ids) // 2  # mid-object
    resumed_start = start(PROMPTS[0], json_schema=schema)
    resumed_start.resume_token_ids.extend(whole.token_ids[:cut])
    rest: Generation = await generate(stub, resumed_start)
    assert whole.token_ids[:cut] + rest.token_ids == whole.token_ids
    jsonschema.validate(json.loads(whole.text), SCHEMAS[0])
    # Token ids outside the vocabulary are refused before the grammar sees them (a negative
    # int32 overflowed llguidance's conversion: an INTERNAL found by the property suite).
    for outside in (-1, 10**9):
        odd = start(PROMPTS[0], json_schema=schema)
        odd.resume_token_ids.extend([outside])
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await generate(stub, odd)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (caught.value.details() or "").startswith("resume_token_ids:")
    # Resumed tokens the grammar refuses are not a valid resume of this request.
    bad = start(PROMPTS[0], json_schema=schema)
    bad.resume_token_ids.extend(whole.token_ids[1:cut])  # drops the opening brace
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(stub, bad)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("resume_token_ids:")
