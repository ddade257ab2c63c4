"""OpenAI request bodies become the router's turns, or a 400 that names the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.router.api.openai.errors import ApiError
from services.router.api.openai.params import chat_generation, completion_generation
from services.router.api.openai.responses import response_generation

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USER = [{"role": "user", "content": "hi"}]


def _called(name: str, arguments: Any, call_id: str = "c1") -> dict[str, Any]:
    """An assistant message that made one call, as a client sends it back."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


CALLED = [_called("weather", '{"city": "Oslo"}')]


def refused(body: Any, completions: bool = False) -> ApiError:
    with pytest.raises(ApiError) as caught:
        (completion_generation if completions else chat_generation)(body, "chatcmpl-1")
    assert caught.value.status == 400
    return caught.value


def test_sampling_fields_reach_the_turn() -> None:
    g = chat_generation(
        {
            "model": "m",
            "messages": USER,
            "max_completion_tokens": 7,
            "max_tokens": 99,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 11,
            "stop": "END",
            "repetition_penalty": 1.2,
            "ignore_eos": True,
        },
        "chatcmpl-1",
    )
    (turn,) = g.turns
    s = turn.sampling
    assert turn.model == "m" and turn.request_id == "chatcmpl-1"
    assert s.max_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert (round(s.temperature, 3), round(s.top_p, 3), s.seed, list(s.stop)) == (0.5, 0.9, 11, ["END"])
    assert round(s.repetition_penalty, 3) == 1.2 and s.ignore_eos


def test_openai_penalties_and_logit_bias_reach_the_engine() -> None:
    body = {
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "logit_bias": {"42": -100, "7": 2.5},
        "min_tokens": 5,
        "stop_token_ids": [2, 9],
        "min_p": 0.05,
        "include_stop_str_in_output": True,
        "allowed_token_ids": [5, 6],
        "bad_words": ["darn", "heck it"],
    }
    for g in (
        chat_generation({"messages": USER, **body}, "c"),
        completion_generation({"prompt": "a", **body}, "p"),
        response_generation({"input": "a", **body}, "r").generation,
    ):
        s = g.turns[0].sampling
        assert (s.presence_penalty, s.frequency_penalty) == (0.5, -1.0)
        assert dict(s.logit_bias) == {42: -100.0, 7: 2.5} and s.min_tokens == 5
        assert list(s.stop_token_ids) == [2, 9] and round(s.min_p, 6) == 0.05
        assert s.include_stop_str_in_output and list(s.allowed_token_ids) == [5, 6]
        assert list(s.bad_words) == ["darn", "heck it"]
    # Zero and null are OpenAI's defaults: nothing is set, so the answer (and cache key) is a plain one.
    s = chat_generation({"messages": USER, "presence_penalty": 0, "logit_bias": None}, "c").turns[0].sampling
    assert not s.HasField("presence_penalty") and not s.logit_bias


def test_text_parts_are_joined_and_developer_is_system() -> None:
    g = chat_generation(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        },
        "x",
    )
    messages = g.turns[0].messages
    assert [(m.role, m.content) for m in messages] == [("system", "be brief"), ("user", "a\nb")]


def test_n_choices_get_their_own_ids_and_distinct_seeds() -> None:
    g = chat_generation({"messages": USER, "n": 3, "seed": 5, "temperature": 1}, "chatcmpl-9")
    assert [t.request_id for t in g.turns] == ["chatcmpl-9-0", "chatcmpl-9-1", "chatcmpl-9-2"]
    assert [t.sampling.seed for t in g.turns] == [5, 6, 7]


def test_completions_are_raw_prompt_major_and_default_to_16_tokens() -> None:
    g = completion_generation({"prompt": ["a", "b"], "n": 2}, "cmpl-1")
    # Raw prompts, as OpenAI and vLLM serve /v1/completions: no chat message, so no template.
    assert [t.prompt for t in g.turns] == ["a", "a", "b", "b"]
    assert not any(t.messages for t in g.turns)
    assert all(t.sampling.max_tokens == 16 for t in g.turns)


def test_chat_and_responses_without_a_limit_may_use_the_whole_context() -> None:
    """As OpenAI's and vLLM's: the SDKs and LangChain send no max_tokens, and the engine's own
    default (256) cut their answers."""
    from services.common.errors import InvalidArgument
    from services.gen.llmmesh.v1 import common_pb2
    from services.inference.servicer import sampling_from_pb

    for turn in (
        chat_generation({"messages": USER}, "c1").turns[0],
        response_generation({"input": "hi"}, "r1").generation.turns[0],
    ):
        assert not turn.sampling.HasField("max_tokens") and turn.sampling.max_tokens_to_context
        assert sampling_from_pb(turn.sampling, prompt_len=100, max_model_len=8192).max_tokens == 8092
    limited = chat_generation({"messages": USER, "max_completion_tokens": 7}, "c2").turns[0].sampling
    assert limited.max_tokens == 7 and not limited.max_tokens_to_context
    # The native API keeps its default: 256, capped by the context.
    native = common_pb2.SamplingParams()
    assert sampling_from_pb(native, prompt_len=100, max_model_len=8192).max_tokens == 256
    assert sampling_from_pb(native, prompt_len=8000, max_model_len=8192).max_tokens == 192
    # min_tokens beyond what the context leaves is still refused, naming it.
    with pytest.raises(InvalidArgument, match=r"^min_tokens"):
        sampling_from_pb(common_pb2.SamplingParams(max_tokens_to_context=True, min_tokens=9000), 100, 8192)


def test_nulls_and_load_tool_extras_are_accepted() -> None:
    g = chat_generation(
        {
            "messages": USER,
            "temperature": None,
            "stop": None,
            "tools": None,
            "presence_penalty": 0,
            "min_tokens": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "user": "u",
            "some_future_field": {"x": 1},
            # vLLM's answer-changing extras at their defaults, as vLLM's clients send them.
            "echo": False,
            "add_generation_prompt": True,
            "continue_final_message": False,
            "skip_special_tokens": True,
            "include_stop_str_in_output": False,
            "min_p": 0.0,
            "chat_template_kwargs": {},
            "bad_words": [],
        },
        "x",
    )
    assert g.stream and g.include_usage
    assert not g.turns[0].sampling.HasField("temperature")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
        ({"messages": USER, "temperature": 2.5}, "temperature"),
        ({"messages": USER, "temperature": "hot"}, "temperature"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "max_tokens": True}, "max_tokens"),
        ({"messages": USER, "n": 9}, "n"),
        ({"messages": USER, "seed": -(2**63) - 1}, "seed"),
        ({"messages": USER, "seed": 2**64}, "seed"),
        ({"messages": USER, "stop": [1]}, "stop"),
        ({"messages": USER, "stop": "x" * 513}, "stop"),
        ({"messages": USER, "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": USER, "frequency_penalty": -2.1}, "frequency_penalty"),
        ({"messages": USER, "frequency_penalty": "high"}, "frequency_penalty"),
        ({"messages": USER, "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
        ({"messages": USER, "min_tokens": -1}, "min_tokens"),
        ({"messages": USER, "stop_token_ids": 2}, "stop_token_ids"),
        ({"messages": USER, "stop_token_ids": [2, "3"]}, "stop_token_ids"),
        ({"messages": USER, "stop_token_ids": [-2]}, "stop_token_ids"),
        ({"messages": USER, "allowed_token_ids": {"5": 1}}, "allowed_token_ids"),
        ({"messages": USER, "allowed_token_ids": [1.5]}, "allowed_token_ids"),
        ({"messages": USER, "bad_words": "darn"}, "bad_words"),
        ({"messages": USER, "bad_words": ["  "]}, "bad_words"),
        ({"messages": USER, "bad_words": ["w"] * 65}, "bad_words"),
        ({"messages": USER, "allowed_token_ids": list(range(16_385))}, "allowed_token_ids"),
        ({"messages": USER, "stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0]"),
        # Two tools of one name: a call names only the function, so which one it meant is unknown.
        (
            {"messages": USER, "tools": [WEATHER, WEATHER], "tool_choice": "required"},
            "tools[1].function.name",
        ),
        ({"messages": USER, "tools": [WEATHER]}, "tool_choice"),
        ({"messages": USER, "tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        (
            {
                "messages": USER,
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "tool_choice.function.name",
        ),
        ({"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
        ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"messages": USER, "guided_json": "{not json"}, "guided_json"),
        # A schema sent as a JSON string is read by Python's parser, which has limits of its own.
        ({"messages": USER, "guided_json": "[" * 100_000 + "]" * 100_000}, "guided_json"),
        ({"messages": USER, "guided_json": '{"const": ' + "9" * 5000 + "}"}, "guided_json"),
        ({"messages": USER, "guided_choice": []}, "guided_choice"),
        ({"messages": USER, "guided_choice": [str(i) for i in range(10_001)]}, "guided_choice"),
        ({"messages": USER, "guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex"),
        ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": USER, "logprobs": 2}, "logprobs"),
        ({"messages": USER, "tool_choice": "auto"}, "tool_choice"),
        ({"messages": USER, "logit_bias": [[1, 5]]}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"cat": 5}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"-3": 5}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"1.5": 5}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"99999999999": 5}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"9" * 5000: 5}}, "logit_bias"),
        # JSON integers have no bound: one past float's range is no number (it was an OverflowError, a 500).
        ({"messages": USER, "temperature": 10**400}, "temperature"),
        ({"messages": USER, "frequency_penalty": -(10**400)}, "frequency_penalty"),
        ({"messages": USER, "logit_bias": {"5": 10**400}}, "logit_bias"),
        ({"messages": USER, "rag": {"min_score": 10**400}}, "rag.min_score"),
        ({"messages": USER, "logit_bias": {"1": 101}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"1": "5"}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"1": True}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        # A function's result answers a call made before it; the deprecated functions API is refused.
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        (
            {"messages": [*USER, {"role": "tool", "tool_call_id": "c9", "content": "x"}]},
            "messages[1].tool_call_id",
        ),
        (
            {"messages": [*USER, *CALLED, {"role": "tool", "tool_call_id": "c1", "content": 7}]},
            "messages[2].content",
        ),
        ({"messages": [*USER, {"role": "function", "name": "f", "content": "x"}]}, "messages[1].role"),
        (
            {"messages": [*USER, {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]},
            "messages[1].function_call",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
        ({"messages": [*USER, {"role": "assistant", "tool_calls": {"id": "c"}}]}, "messages[1].tool_calls"),
        (
            {
                "messages": [
                    *USER,
                    {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
                ]
            },
            "messages[1].tool_calls[0].id",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]},
            "messages[1].tool_calls[0].function",
        ),
        (
            {"messages": [*USER, _called("f", {"city": "x"})]},  # arguments are the JSON's text
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [*USER, _called("f", '{"city": "\\ud800"}')]},  # escaped lone surrogate
            "messages[1].tool_calls",
        ),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        # vLLM's extras that would change the prompt or the answer, away from their defaults.
        ({"messages": USER, "echo": True}, "echo"),
        ({"messages": USER, "add_generation_prompt": False}, "add_generation_prompt"),
        ({"messages": USER, "continue_final_message": True}, "continue_final_message"),
        ({"messages": USER, "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({"messages": USER, "skip_special_tokens": False}, "skip_special_tokens"),
        ({"messages": USER, "min_p": 1.1}, "min_p"),
        ({"messages": USER, "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
        ({"messages": USER, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ({"messages": USER, "chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": USER, "chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
        # As the Responses API refuses `reasoning` and `text.verbosity` (it was ignored here).
        ({"messages": USER, "reasoning_effort": "high"}, "reasoning_effort"),
        ({"messages": USER, "verbosity": "low"}, "verbosity"),
        ({"messages": USER, "web_search_options": {"search_context_size": "low"}}, "web_search_options"),
        (
            {"messages": USER, "stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
    ],
)
def test_bad_or_unsupported_fields_are_refused_by_name(body: dict[str, Any], param: str) -> None:
    assert refused(body).param == param


def test_an_assistant_message_with_null_or_no_content_is_an_empty_turn() -> None:
    # OpenAI's schema has an assistant's content nullable; it was a 400 on messages[1].content.
    for assistant in ({"role": "assistant", "content": None}, {"role": "assistant"}):
        g = chat_generation({"messages": [*USER, assistant, {"role": "user", "content": "and?"}]}, "x")
        messages = g.turns[0].messages
        assert [(m.role, m.content) for m in messages] == [
            ("user", "hi"),
            ("assistant", ""),
            ("user", "and?"),
        ]


def test_echo_asks_for_the_prompts_logprobs_and_keeps_each_choices_prompt_text() -> None:
    g = completion_generation({"prompt": ["a", "b"], "echo": True, "logprobs": 2}, "cmpl-4")
    assert g.echo == ("a", "b")
    ids = completion_generation({"prompt": [[7, 8], [9]], "echo": True, "n": 2}, "cmpl-7")
    assert ids.echo == (None,) * 4  # a token-id prompt's text comes back with its tokens
    assert all(t.sampling.HasField("prompt_logprobs") and t.sampling.prompt_logprobs == 2 for t in g.turns)
    plain = completion_generation({"prompt": "a", "echo": True}, "cmpl-5")
    assert plain.turns[0].sampling.prompt_logprobs == 0 and not plain.turns[0].sampling.logprobs
    assert not completion_generation({"prompt": "a"}, "cmpl-6").turns[0].sampling.HasField("prompt_logprobs")
    streamed = completion_generation({"prompt": "a", "echo": True, "stream": True}, "cmpl-8")
    assert streamed.stream and streamed.echo == ("a",)
    assert refused({"prompt": "a", "echo": "yes"}, completions=True).param == "echo"


def test_completions_refuse_prompts_of_no_openai_shape() -> None:
    assert refused({"prompt": 5}, completions=True).param == "prompt"
    assert refused({"prompt": ["a", ""]}, completions=True).param == "prompt"
    for shape in ([], [[]], [1, [2]], ["a", 1], [[1], "a"], {"ids": [1]}):
        assert refused({"prompt": shape}, completions=True).param == "prompt", shape


def test_token_id_prompts_go_to_the_replica_as_ids_one_turn_each() -> None:
    # OpenAI's and vLLM's /v1/completions take a prompt as token ids, one list or several.
    g = completion_generation({"prompt": [5, 0, 7], "n": 2}, "cmpl-2")
    assert [list(t.prompt_token_ids) for t in g.turns] == [[5, 0, 7], [5, 0, 7]]
    assert not any(t.prompt or t.messages for t in g.turns)
    g = completion_generation({"prompt": [[1, 2], [3]]}, "cmpl-3")
    assert [list(t.prompt_token_ids) for t in g.turns] == [[1, 2], [3]]


def test_a_token_id_that_is_no_int32_is_refused_naming_where() -> None:
    for ids, where in (
        ([1, -1], "prompt[1]"),
        ([True, 2], "prompt[0]"),
        ([1, 2.5], "prompt[1]"),
        ([2**31], "prompt[0]"),
    ):
        error = refused({"prompt": ids}, completions=True)
        assert error.param == "prompt" and error.message.startswith(where), (ids, error.message)
    error = refused({"prompt": [[1], [2, -3]]}, completions=True)
    assert error.message.startswith("prompt[1][1]"), error.message


def test_a_body_that_is_not_an_object_is_refused() -> None:
    assert refused([1, 2]).param is None


def test_structured_output_fields_become_the_engine_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    sampling = chat_generation({"messages": USER, "response_format": fmt}, "r").turns[0].sampling
    assert json.loads(sampling.json_schema) == schema
    sampling = (
        chat_generation({"messages": USER, "response_format": {"type": "json_object"}}, "r").turns[0].sampling
    )
    assert sampling.WhichOneof("constraint") == "json_object" and sampling.json_object
    sampling = chat_generation({"messages": USER, "response_format": {"type": "text"}}, "r").turns[0].sampling
    assert sampling.WhichOneof("constraint") is None
    sampling = chat_generation({"messages": USER, "guided_choice": ["yes", "no"]}, "r").turns[0].sampling
    assert list(sampling.choice.values) == ["yes", "no"]
    sampling = completion_generation({"prompt": "x", "guided_regex": r"\d+"}, "r").turns[0].sampling
    assert sampling.regex == r"\d+"


def test_logprobs_fields_map_to_the_engine_for_both_endpoints() -> None:
    chat = chat_generation({"messages": USER, "logprobs": True, "top_logprobs": 5}, "r").turns[0].sampling
    assert (chat.logprobs, chat.top_logprobs) == (True, 5)
    text = completion_generation({"prompt": "x", "logprobs": 3}, "r").turns[0].sampling
    assert (text.logprobs, text.top_logprobs) == (True, 3)
    off = chat_generation({"messages": USER, "logprobs": False}, "r").turns[0].sampling
    assert (off.logprobs, off.top_logprobs) == (False, 0)


def test_a_named_tool_choice_constrains_the_answer_to_its_parameters() -> None:
    named = {"type": "function", "function": {"name": "weather"}}
    generation = chat_generation({"messages": USER, "tools": [WEATHER], "tool_choice": named}, "r")
    assert json.loads(generation.turns[0].sampling.json_schema) == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert generation.tool is not None
    assert generation.tool.call('{"city": "Oslo"}', "c1") == {
        "id": "c1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }


def test_required_tool_choice_lets_the_model_pick_one_of_the_tools() -> None:
    clock = {"type": "function", "function": {"name": "time"}}
    generation = chat_generation(
        {"messages": USER, "tools": [WEATHER, clock], "tool_choice": "required"}, "r"
    )
    schema = json.loads(generation.turns[0].sampling.json_schema)
    assert [b["properties"]["name"]["const"] for b in schema["anyOf"]] == ["weather", "time"]
    assert generation.tool is not None
    call = generation.tool.call('{"name": "time", "arguments": {}}', "c2")
    assert call is not None and call["function"] == {"name": "time", "arguments": "{}"}
    assert generation.tool.call('{"name": "ti', "c3") is None  # cut short: not a call
    # An integer past Python's 4,300-digit reading limit: no call either, never a 500.
    assert generation.tool.call('{"name": "time", "arguments": {"n": ' + "9" * 5000 + "}}", "c4") is None
    assert chat_generation({"messages": USER, "tools": [WEATHER], "tool_choice": "none"}, "r").tool is None


@pytest.mark.parametrize(
    ("body", "sent"),
    [
        ({"guided_choice": ["yes", "no"]}, "guided_choice"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"guided_grammar": 'root ::= "a"'}, "guided_grammar"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {}}}},
            "response_format.json_schema.schema",
        ),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tools"),
        # A named call is constrained by that one function's parameters: the refusal names them.
        (
            {
                "tools": [WEATHER, {"type": "function", "function": {"name": "time", "parameters": {}}}],
                "tool_choice": {"type": "function", "function": {"name": "time"}},
            },
            "tools[1].function.parameters",
        ),
    ],
)
def test_a_replicas_refusal_of_the_constraint_names_the_field_the_client_sent(
    body: dict[str, Any], sent: str
) -> None:
    generation = chat_generation({"messages": USER, **body}, "r")
    engine = generation.turns[0].sampling.WhichOneof("constraint")
    assert generation.constraint is not None and engine is not None
    # As a replica's INVALID_ARGUMENT arrives: its message starts with the proto field.
    refusal = ApiError(
        400, f"{engine}: does not compile: bad", "invalid_request_error", "invalid_value", engine
    )
    renamed = generation.constraint.rename(refusal)
    assert (renamed.param, renamed.message) == (sent, f"{sent}: does not compile: bad")
    # Another field's error keeps its name; a request without a constraint renames nothing.
    other = ApiError(400, "resume_token_ids: x", "invalid_request_error", "invalid_value", "resume_token_ids")
    assert generation.constraint.rename(other) == other
    assert chat_generation({"messages": USER}, "r").constraint is None
    text = completion_generation({"prompt": "x", **body}, "r") if "tools" not in body else None
    assert text is None or (text.constraint is not None and text.constraint.request == sent)


def test_earlier_calls_and_their_results_become_the_conversation_the_model_reads() -> None:
    clock = {"id": "c2", "type": "function", "function": {"name": "time", "arguments": "{}"}}
    weather = {
        "id": "c1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
    }
    messages = [
        *USER,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [weather, clock]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 °C, snow"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "12:00"}]},
        {"role": "user", "content": "So?"},
    ]
    (turn,) = chat_generation({"messages": messages}, "r").turns
    assert [(m.role, m.content) for m in turn.messages] == [
        ("user", "hi"),
        # The calls as the model writes a `required` call: one JSON object a line, its separators.
        (
            "assistant",
            'Let me look.\n{"name": "weather", "arguments": {"city": "Oslo"}}\n{"name": "time", "arguments": {}}',
        ),
        ("tool", "-3 °C, snow"),
        ("tool", "12:00"),
        ("user", "So?"),
    ]
    # instructor's re-ask after a failed validation (Mode.TOOLS): an empty content beside the
    # calls, and the tool message naming its function; the name is not shown to the model.
    reask = [
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [weather]},
        {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "Validation Error found: …"},
    ]
    (turn,) = chat_generation({"messages": reask}, "r").turns
    assert [(m.role, m.content) for m in turn.messages][1:] == [
        ("assistant", '{"name": "weather", "arguments": {"city": "Oslo"}}'),
        ("tool", "Validation Error found: …"),
    ]
    # A call whose arguments are not JSON (a client's own), or JSON Python's reader refuses, is
    # read as it was sent.
    for arguments in ("not json", "9" * 5000, "[" * 100_000 + "]" * 100_000):
        (turn,) = chat_generation({"messages": [*USER, _called("f", arguments), *USER]}, "r").turns
        assert turn.messages[1].content == json.dumps({"name": "f", "arguments": arguments})


def test_a_tool_result_may_answer_a_call_in_the_sessions_stored_history() -> None:
    """With a session, a client sends only the new messages: the call its tool result answers
    is in the stored history. It was a 400 (and re-sending the call saved it twice)."""
    result = {"role": "tool", "tool_call_id": "call_1", "content": "-3 °C"}
    assert refused({"messages": [result]}).param == "messages[0].tool_call_id"
    (turn,) = chat_generation({"messages": [result], "session_id": "s1"}, "chatcmpl-1").turns
    assert [(m.role, m.content) for m in turn.messages] == [("tool", "-3 °C")]
    output = {"type": "function_call_output", "call_id": "call_1", "output": "-3 °C"}
    with pytest.raises(ApiError):
        response_generation({"input": [output]}, "resp-1")
    (answered,) = response_generation({"input": [output], "session_id": "s1"}, "resp-1").generation.turns
    assert answered.messages[-1].content == "-3 °C"


def test_openais_signed_seed_and_zero_top_p_are_taken_as_openai_takes_them() -> None:
    """OpenAI's seed is a signed 64-bit integer (apps send -1 for "any seed") and its top_p may
    be 0: both were 400s."""
    (negative,) = chat_generation({"messages": USER, "seed": -1, "temperature": 1}, "r").turns
    assert negative.sampling.seed == 2**64 - 1
    (lowest,) = chat_generation({"messages": USER, "seed": -(2**63)}, "r").turns
    assert lowest.sampling.seed == 2**63
    (nucleus_of_one,) = chat_generation(
        {"messages": USER, "top_p": 0, "top_k": 40, "temperature": 1}, "r"
    ).turns
    assert nucleus_of_one.sampling.top_k == 1 and not nucleus_of_one.sampling.HasField("top_p")


@pytest.mark.parametrize("top_p", [1e-46, 1e-300, 5e-324])
def test_a_top_p_below_float32s_range_is_zero_not_a_refusal_of_a_value_never_sent(top_p: float) -> None:
    # It passed the front's check as a float64 > 0, became 0.0 in the proto's float32, and the
    # replica refused it: "top_p: must be in (0, 1], got 0.0".
    (turn,) = chat_generation({"messages": USER, "top_p": top_p, "temperature": 1}, "r").turns
    assert turn.sampling.top_k == 1 and not turn.sampling.HasField("top_p")
    (smallest,) = chat_generation({"messages": USER, "top_p": 1e-45, "temperature": 1}, "r").turns
    assert smallest.sampling.top_p > 0 and not smallest.sampling.top_k  # still a float32 > 0: kept


def test_the_neutral_reasoning_verbosity_and_search_values_are_taken_on_chat_as_on_responses() -> None:
    body = {"messages": USER, "reasoning_effort": "none", "verbosity": "medium", "web_search_options": {}}
    (turn,) = chat_generation(body, "r").turns
    assert [m.content for m in turn.messages] == ["hi"]
    (same,) = response_generation({"input": "hi", "reasoning": {"effort": "none"}}, "r").generation.turns
    assert [m.content for m in same.messages] == ["hi"]
