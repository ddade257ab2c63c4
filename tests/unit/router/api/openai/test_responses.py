"""The Responses API: bodies become one chat turn or a 400 naming the field; a stream's typed events
come in OpenAI's order, and a failure after it began ends it with ``error`` and ``response.failed``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.common import errors
from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.api.openai.choices import ChoiceAnswer, ChoiceStreams
from services.router.api.openai.errors import ApiError
from services.router.api.openai.params import chat_generation
from services.router.api.openai.response_events import ResponseFramer
from services.router.api.openai.responses import response_generation

#: A function call as the Responses API gives it back in ``input``.
_CALL = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'}


def refused(body: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        response_generation(body, "r1")
    assert caught.value.status == 400
    return caught.value


def test_instructions_and_input_messages_become_one_chat_turn() -> None:
    wanted = response_generation(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "hi"},
                # An earlier answer, as LangChain and the SDK replay one: a typed item with its id.
                {
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "hello", "annotations": []}],
                },
                {
                    "type": "message",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "terse"}],
                },
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
                },
            ],
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "metadata": {"k": "v"},
            "store": True,
            "tool_choice": "auto",
            "tools": [],
            "reasoning": {"effort": None},
            "truncation": "disabled",
        },
        "r1",
    )
    (turn,) = wanted.generation.turns
    assert [(m.role, m.content) for m in turn.messages] == [
        ("system", "Be brief."),
        ("user", "hi"),
        ("assistant", "hello"),
        ("system", "terse"),
        ("user", "a\nb"),
    ]
    assert turn.request_id == "r1" and turn.model == "m"
    assert turn.sampling.max_tokens == 7
    assert turn.sampling.temperature == pytest.approx(0.5) and turn.sampling.top_p == pytest.approx(0.9)
    assert wanted.metadata == {"k": "v"} and wanted.text == {"format": {"type": "text"}}


def test_a_string_input_is_the_users_message_and_unset_sampling_is_the_engines_default() -> None:
    wanted = response_generation({"input": "hello"}, "r1")
    (turn,) = wanted.generation.turns
    assert [(m.role, m.content) for m in turn.messages] == [("user", "hello")]
    assert not turn.sampling.HasField("temperature") and not turn.sampling.HasField("max_tokens")
    assert (wanted.temperature, wanted.top_p) == (1.0, 1.0)  # what OpenAI's response object reports


def test_text_format_is_the_constraint_and_logprobs_come_with_include() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    wanted = response_generation(
        {
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}},
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 3,
        },
        "r1",
    )
    sampling = wanted.generation.turns[0].sampling
    assert json.loads(sampling.json_schema) == schema
    assert sampling.logprobs and sampling.top_logprobs == 3 and wanted.logprobs
    assert wanted.generation.constraint is not None
    assert wanted.generation.constraint.request == "text.format.schema"
    assert (
        response_generation({"input": "x", "text": {"format": {"type": "json_object"}}}, "r")
        .generation.turns[0]
        .sampling.json_object
    )


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({}, "input", "invalid_value"),
        ({"input": ""}, "input", "invalid_value"),
        ({"input": []}, "input", "invalid_value"),
        ({"input": [7]}, "input[0]", "invalid_value"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "invalid_value"),
        # A function's output answers a call made earlier in the input, and names it.
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id", "invalid_value"),
        (
            {"input": [_CALL, {"type": "function_call_output", "call_id": "c9", "output": "1"}]},
            "input[1].call_id",
            "invalid_value",
        ),
        (
            {"input": [_CALL, {"type": "function_call_output", "call_id": "c1", "output": 1}]},
            "input[1].output",
            "invalid_value",
        ),
        ({"input": [{**_CALL, "call_id": None}]}, "input[0].call_id", "invalid_value"),
        ({"input": [{**_CALL, "name": ""}]}, "input[0].name", "invalid_value"),
        ({"input": [{**_CALL, "arguments": {"city": "x"}}]}, "input[0].arguments", "invalid_value"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "unsupported_parameter"),
        ({"input": [{"type": "item_reference", "id": "fc_1"}]}, "input[0].type", "unsupported_parameter"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
            "unsupported_parameter",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
            "invalid_value",
        ),
        ({"input": "x", "instructions": 3}, "instructions", "invalid_value"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"input": "x", "background": True}, "background", "unsupported_parameter"),
        ({"input": "x", "truncation": "auto"}, "truncation", "unsupported_parameter"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
        ({"input": "x", "tools": {"type": "function"}}, "tools", "invalid_value"),
        ({"input": "x", "tools": ["f"]}, "tools[0]", "invalid_value"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0]", "invalid_value"),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f"}] * 2, "tool_choice": "required"},
            "tools[1].name",
            "invalid_value",
        ),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 3}]},
            "tools[0].parameters",
            "invalid_value",
        ),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f"}]},
            "tool_choice",
            "unsupported_parameter",
        ),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": "auto"},
            "tool_choice",
            "unsupported_parameter",
        ),
        (
            {
                "input": "x",
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "tool_choice.name",
            "invalid_value",
        ),
        (
            {
                "input": "x",
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "file_search"},
            },
            "tool_choice",
            "unsupported_parameter",
        ),
        (
            {
                "input": "x",
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "tool_choice",
            "invalid_value",
        ),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "invalid_value"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"input": "x", "temperature": 3}, "temperature", "invalid_value"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type", "unsupported_parameter"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema", "invalid_value"),
        ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity", "unsupported_parameter"),
        ({"input": "x", "top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"input": "x", "include": "all"}, "include", "invalid_value"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata", "invalid_value"),
        ({"input": "x", "n": 2}, "n", "unsupported_parameter"),
        ({"input": "x", "resumable": True}, "resumable", "unsupported_parameter"),
        ({"input": "x", "presence_penalty": 3}, "presence_penalty", "invalid_value"),
        ({"input": "x", "logit_bias": {"x": 1}}, "logit_bias", "invalid_value"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    body: dict[str, Any], param: str, code: str
) -> None:
    error = refused(body)
    assert (error.param, error.code) == (param, code), error.message
    assert error.message.startswith(param), error.message


def _end(reason: int, completion: int) -> router_pb2.ChatResponse:
    usage = common_pb2.Usage(prompt_tokens=9, completion_tokens=completion, cached_prompt_tokens=4)
    return router_pb2.ChatResponse(end=router_pb2.TurnEnd(finish_reason=reason, usage=usage, model="m"))


def _delta(text: str) -> router_pb2.ChatResponse:
    return router_pb2.ChatResponse(delta=router_pb2.TokenDelta(text=text))


async def _turn(*messages: router_pb2.ChatResponse | Exception) -> AsyncIterator[router_pb2.ChatResponse]:
    for m in messages:
        if isinstance(m, Exception):
            raise m
        yield m


async def _events(
    *messages: router_pb2.ChatResponse | Exception, body: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    framer = ResponseFramer(response_generation(body or {"input": "x"}, "r1"), "resp_r1", 1, "m")
    streams = ChoiceStreams([_turn(*messages)])
    first = await streams.next()
    assert first is not None
    out = []
    async for chunk in framer.events(streams, first, keepalive_s=5):
        head, data = chunk.decode().strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        out.append(payload)
    await streams.close()
    return out


async def test_a_stream_is_openais_event_sequence_numbered_from_zero() -> None:
    events = await _events(_delta("Hel"), _delta("lo"), _end(common_pb2.FINISH_REASON_STOP, 2))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    final = events[-1]["response"]
    assert final["id"] == "resp_r1" and final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["output"][0]["id"] == events[2]["item"]["id"] == events[4]["item_id"]
    assert final["usage"] == {
        "input_tokens": 9,
        "input_tokens_details": {"cached_tokens": 4},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 11,
    }


async def test_an_answer_cut_by_max_output_tokens_ends_incomplete() -> None:
    events = await _events(_delta("a"), _end(common_pb2.FINISH_REASON_LENGTH, 1))
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


async def test_a_failure_after_the_stream_began_is_an_error_event_then_response_failed() -> None:
    events = await _events(_delta("par"), errors.DependencyUnavailable("every replica failed"))
    assert [e["type"] for e in events[-3:]] == ["response.output_text.delta", "error", "response.failed"]
    assert events[-2]["code"] == "service_unavailable" and "every replica failed" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "service_unavailable"
    assert failed["output"][0]["content"][0]["text"] == "par"  # what the client had, kept
    assert failed["output"][0]["status"] == "incomplete"


async def test_llm_meshs_extras_come_back_on_the_finished_response_when_the_request_used_them() -> None:
    end = _end(common_pb2.FINISH_REASON_STOP, 1)
    end.end.session_id, end.end.session_version = "s1", 3
    plain = await _events(_delta("a"), end)
    assert "llm_mesh" not in plain[-1]["response"]
    with_session = await _events(_delta("a"), end, body={"input": "x", "session_id": "s1"})
    extras = with_session[-1]["response"]["llm_mesh"]
    assert (extras["session_id"], extras["session_version"]) == ("s1", 3)


WEATHER = {
    "type": "function",
    "name": "weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CLOCK = {"type": "function", "name": "clock", "parameters": {"type": "object", "properties": {}}}


def test_a_forced_function_call_constrains_the_answer_to_the_functions_parameters() -> None:
    named = response_generation(
        {"input": "x", "tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "name": "weather"}},
        "r1",
    )
    (turn,) = named.generation.turns
    assert json.loads(turn.sampling.json_schema) == WEATHER["parameters"]
    assert named.tools == [WEATHER, CLOCK] and named.tool_choice == {"type": "function", "name": "weather"}
    required = response_generation({"input": "x", "tools": [WEATHER, CLOCK], "tool_choice": "required"}, "r1")
    schema = json.loads(required.generation.turns[0].sampling.json_schema)
    assert [b["properties"]["name"] for b in schema["anyOf"]] == [{"const": "weather"}, {"const": "clock"}]
    # Offered but not to be called, or no tools at all with OpenAI's default: a plain text answer.
    for body in ({"tools": [WEATHER], "tool_choice": "none"}, {"tools": [], "tool_choice": "auto"}):
        plain = response_generation({"input": "x", **body}, "r1")
        assert plain.generation.tool is None and not plain.generation.turns[0].sampling.HasField(
            "json_schema"
        )
    # The replica's refusal of the schema names what the request sent: the named function's
    # parameters, or the tools when the constraint joins them all.
    assert named.generation.constraint is not None
    assert named.generation.constraint.request == "tools[0].parameters"
    assert required.generation.constraint is not None and required.generation.constraint.request == "tools"


async def test_a_forced_call_is_a_function_call_item_whole_and_streamed() -> None:
    body = {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "weather"}}
    framer = ResponseFramer(response_generation(body, "r1"), "resp_r1", 1, "m")
    whole = framer.whole(ChoiceAnswer(['{"city": ', '"Paris"}'], _end(common_pb2.FINISH_REASON_STOP, 5).end))
    (call,) = whole["output"]
    assert call == {
        "id": "fc_r1",
        "type": "function_call",
        "status": "completed",
        "call_id": "call_r1",
        "name": "weather",
        "arguments": '{"city": "Paris"}',
    }
    assert whole["tools"] == [WEATHER] and whole["tool_choice"] == body["tool_choice"]
    events = await _events(
        _delta('{"city": '), _delta('"Paris"}'), _end(common_pb2.FINISH_REASON_STOP, 5), body=body
    )
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[2]["item"] == {**call, "arguments": "", "status": "in_progress"}
    assert (
        events[3]["delta"] == events[4]["arguments"] == call["arguments"] and events[4]["name"] == "weather"
    )
    assert events[3]["item_id"] == events[4]["item_id"] == "fc_r1"
    assert events[5]["item"] == call and events[-1]["response"]["output"] == [call]


async def test_a_required_call_names_its_function_and_one_cut_short_stays_text() -> None:
    body = {"input": "x", "tools": [WEATHER, CLOCK], "tool_choice": "required"}
    events = await _events(
        _delta('{"name": "clock", '),
        _delta('"arguments": {}}'),
        _end(common_pb2.FINISH_REASON_STOP, 9),
        body=body,
    )
    (call,) = events[-1]["response"]["output"]
    assert (call["type"], call["name"], call["arguments"]) == ("function_call", "clock", "{}")
    # Cut by max_output_tokens before the call was whole: no call to make, so the text as a message.
    cut = await _events(_delta('{"name": "clo'), _end(common_pb2.FINISH_REASON_LENGTH, 4), body=body)
    assert [e["type"] for e in cut[2:]] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    (message,) = cut[-1]["response"]["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == '{"name": "clo'
    assert message["status"] == "incomplete"


def test_earlier_calls_and_their_outputs_become_the_conversation_the_model_reads() -> None:
    clock = {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "time", "arguments": "{}"}
    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "Weather and time?"},
            _CALL,
            clock,  # consecutive calls: one assistant turn, as a parallel call in chat
            {"type": "function_call_output", "call_id": "c1", "output": "-3 °C, snow"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "12:00"}],
            },
            {"role": "user", "content": "So?"},
        ],
    }
    (turn,) = response_generation(body, "r1").generation.turns
    assert [(m.role, m.content) for m in turn.messages] == [
        ("system", "Be brief."),
        ("user", "Weather and time?"),
        (
            "assistant",
            '{"name": "weather", "arguments": {"city": "Oslo"}}\n{"name": "time", "arguments": {}}',
        ),
        ("tool", "-3 °C, snow"),
        ("tool", "12:00"),
        ("user", "So?"),
    ]
    # Chat and Responses render the same history the same way (one prompt, one cache entry).
    chat = chat_generation(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather and time?"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": c["call_id"],
                            "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]},
                        }
                        for c in (_CALL, clock)
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "-3 °C, snow"},
                {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
                {"role": "user", "content": "So?"},
            ]
        },
        "r1",
    )
    assert list(chat.turns[0].messages) == list(turn.messages)
