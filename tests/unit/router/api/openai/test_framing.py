"""Usage and chunk shapes the OpenAI clients read."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.api.openai.choices import ChoiceAnswer, ChoiceStreams
from services.router.api.openai.framing import DONE, KEEPALIVE, KEEPALIVE_WITH_IDS, Framer, sse, total_usage
from services.router.api.openai.streaming import sse_body
from services.router.api.openai.structured import ToolMode
from tests.support.openai_front import load_tool_texts


def usage(prompt: int, completion: int, cached: int = 0) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_prompt_tokens=cached)


def test_the_prompt_counts_once_per_prompt_however_many_choices() -> None:
    # Two prompts (10 and 7 tokens), n=2 each: prompts counted once each, completions summed.
    # A prompt's cached tokens are the fewest its choices found: choice 1 found 8 of prompt 0's
    # tokens because choice 0 had just computed them, which the client did not get for free.
    by_choice = {0: usage(10, 3), 1: usage(10, 4, 8), 2: usage(7, 5, 4), 3: usage(7, 1, 6)}
    assert total_usage(by_choice, per_prompt=2) == {
        "prompt_tokens": 17,
        "completion_tokens": 13,
        "total_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_a_whole_chat_answer_has_openais_shape() -> None:
    end = router_pb2.TurnEnd(finish_reason=common_pb2.FINISH_REASON_STOP, usage=usage(5, 2), model="m-v2")
    body = Framer("chat", "chatcmpl-1", 1, "m").whole([ChoiceAnswer(["Hel", "lo"], end)])
    assert body["model"] == "m-v2" and body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"]["total_tokens"] == 7


def test_stream_chunks_carry_null_usage_only_when_usage_was_asked_for() -> None:
    framer = Framer("text", "cmpl-1", 1, "m")
    assert "usage" not in framer.delta(0, "x", with_usage=False)
    assert framer.delta(0, "x", with_usage=True)["usage"] is None
    assert framer.opening(0, True) is None  # text streams have no role chunk
    last = framer.usage({0: usage(3, 2)})
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("keepalive", "ids"), [(KEEPALIVE_WITH_IDS, ["c-1", "c-2"]), (KEEPALIVE, [None, None])]
)
def test_keepalives_between_events_are_invisible_to_the_openai_sdks_parser(
    keepalive: bytes, ids: list[str | None]
) -> None:
    from openai._streaming import SSEDecoder  # the parser the SDK's streams run on

    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
    stream = keepalive + sse(ids[0], chunk) + keepalive + keepalive + sse(ids[1], chunk) + keepalive + DONE
    events = list(SSEDecoder().iter_bytes(iter([stream[i : i + 7] for i in range(0, len(stream), 7)])))
    assert [e.id for e in events] == [*ids, ids[1]]
    assert [e.json() for e in events[:2]] == [chunk, chunk] and events[2].data == "[DONE]"


def test_a_plain_stream_and_its_keepalives_read_as_the_load_tools_read_them() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
    stream = KEEPALIVE + sse(None, chunk) + KEEPALIVE + KEEPALIVE + sse(None, chunk) + KEEPALIVE + DONE
    assert load_tool_texts(stream) == "xx"
    with pytest.raises(AssertionError):  # what they met before: an id line, a comment line
        load_tool_texts(sse("c-1", chunk))
    with pytest.raises(AssertionError):
        load_tool_texts(KEEPALIVE_WITH_IDS + sse(None, chunk))


def test_a_delta_from_its_template_is_the_chunk_openai_clients_parse() -> None:
    # Any text a model can write: quotes, escapes, control and non-ASCII characters, even the
    # text the template is found with.
    texts = ["", " tok", 'say "hi"\\n', "line\nnext\t\x00", "中文 ☃ \u2028", "\x00llm-mesh delta text\x00"]
    for kind in ("chat", "text"):
        framer = Framer(kind, "chatcmpl-7", 1733400000, "m")
        for index in (0, 2):
            for with_usage in (False, True):
                for text in texts:
                    got = json.loads(framer.delta_json(index, text, with_usage))
                    assert got == framer.delta(index, text, with_usage)
                    choice = got["choices"][0]
                    assert (choice["delta"]["content"] if kind == "chat" else choice["text"]) == text
    assert sse("chatcmpl-7-3", framer.delta_json(0, "a", False)) == sse(
        "chatcmpl-7-3", framer.delta(0, "a", False)
    )


def test_an_echoed_token_id_prompt_is_the_replicas_decoded_text_or_its_tokens_from_an_older_one() -> None:
    # "世" is two byte-level tokens; each token's own text stands for its part as U+FFFD.
    split = [common_pb2.TokenLogprobs(text="\ufffd"), common_pb2.TokenLogprobs(text="\ufffd")]
    end = router_pb2.TurnEnd(finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage(2, 1))
    framer = Framer("completion", "cmpl-1", 1, "m", echo=("given", None))
    answers = [
        ChoiceAnswer(["!"], end, prompt_logprobs=split, prompt_text="ignored: sent as text"),
        ChoiceAnswer(["!"], end, prompt_logprobs=split, prompt_text="世"),
    ]
    assert [c["text"] for c in framer.whole(answers)["choices"]] == ["given!", "世!"]
    # A replica from before TokenChunk.prompt_text sends none: its tokens' texts, as before.
    older = ChoiceAnswer(["!"], end, prompt_logprobs=split)
    assert framer.whole([answers[0], older])["choices"][1]["text"] == "\ufffd\ufffd!"
    delta = router_pb2.TokenDelta(text="!", token_ids=[5], prompt_logprobs=split, prompt_text="世")
    assert framer.echo_delta(1, delta, with_usage=False)["choices"][0]["text"] == "世!"


async def _chat_stream(framer: Framer, *messages: router_pb2.ChatResponse) -> list[dict[str, Any]]:
    """The chunks of a one-choice chat stream of ``messages``, as a client parses them."""

    async def turn() -> AsyncIterator[router_pb2.ChatResponse]:
        for m in messages:
            yield m

    streams = ChoiceStreams([turn()])
    first = await streams.next()
    assert first is not None
    body = b"".join([chunk async for chunk in sse_body(streams, framer, first, False, keepalive_s=5)])
    await streams.close()
    data = [line.removeprefix("data: ") for line in body.decode().splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _ended(reason: int) -> router_pb2.ChatResponse:
    return router_pb2.ChatResponse(end=router_pb2.TurnEnd(finish_reason=reason, usage=usage(5, 3)))


def _text(text: str) -> router_pb2.ChatResponse:
    return router_pb2.ChatResponse(delta=router_pb2.TokenDelta(text=text))


async def test_a_streamed_required_call_comes_whole_and_one_cut_short_keeps_its_text() -> None:
    framer = Framer("chat", "c1", 1, "m", tool=ToolMode(None))
    made = await _chat_stream(framer, _text('{"name": "f", '), _text('"arguments": {}}'), _ended(1))
    (call,) = made[-2]["choices"][0]["delta"]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": "{}"}
    assert made[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # Cut short by max_tokens it is no call: the text comes as content, as the whole answer has it.
    cut = await _chat_stream(framer, _text('{"name": "f", '), _text('"argu'), _ended(2))
    texts = [c["choices"][0]["delta"].get("content") for c in cut if c["choices"]]
    assert "".join(t for t in texts if t) == '{"name": "f", "argu'
    assert cut[-1]["choices"][0]["finish_reason"] == "length"
    whole = framer.whole([ChoiceAnswer(['{"name": "f", ', '"argu'], _ended(2).end)])
    assert whole["choices"][0]["message"]["content"] == '{"name": "f", "argu'
    # Complete but past what Python reads (a 5,000-digit integer): text that stopped, not a call.
    huge = '{"name": "f", "arguments": {"n": ' + "9" * 5000 + "}}"
    read = await _chat_stream(framer, _text(huge), _ended(1))
    assert read[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in read if c["choices"]) == huge
    whole = framer.whole([ChoiceAnswer([huge], _ended(1).end)])
    assert (whole["choices"][0]["finish_reason"], whole["choices"][0]["message"]["content"]) == ("stop", huge)


def test_a_streamed_completions_text_offsets_go_on_from_chunk_to_chunk_as_the_whole_bodys() -> None:
    """OpenAI's ``text_offset`` is where each token starts in the choice's text, streamed or not:
    each chunk's go on from the last chunk's of the same choice (they restarted at 0)."""
    tokens = [common_pb2.TokenLogprobs(text=t, logprob=-0.5) for t in ("Hello", ",", " wor", "ld", "!")]
    prompt = [common_pb2.TokenLogprobs(text=t) for t in ("Say", " hi")]
    end = router_pb2.TurnEnd(finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage(2, 5))
    for echo in ((), ("Say hi",)):
        whole = Framer("text", "cmpl-1", 1, "m", echo=echo).whole(
            [
                ChoiceAnswer(
                    [t.text for t in tokens], end, logprobs=tokens, prompt_logprobs=prompt if echo else ()
                )
            ]
        )
        framer = Framer("text", "cmpl-1", 1, "m", echo=echo)
        streamed: list[int] = []
        pieces = [tokens[:2], tokens[2:3], tokens[3:]]
        for i, piece in enumerate(pieces):
            text = "".join(t.text for t in piece)
            if echo and i == 0:
                delta = router_pb2.TokenDelta(text=text, logprobs=piece, prompt_logprobs=prompt)
                chunk = framer.echo_delta(0, delta, with_usage=False)
            else:
                chunk = framer.delta(0, text, with_usage=False, logprobs=piece)
            streamed += chunk["choices"][0]["logprobs"]["text_offset"]
        assert streamed == whole["choices"][0]["logprobs"]["text_offset"]
        assert streamed[-1] == len(("Say hi" if echo else "") + "Hello, world")  # where "!" starts


def test_a_completions_top_logprobs_include_the_chosen_token_as_openais_do() -> None:
    """OpenAI and vLLM list the sampled token among a legacy completion's alternatives (up to
    logprobs + 1 entries); ``logprobs: 0`` gave empty dicts, where clients read the chosen one."""
    from services.router.api.openai.structured import text_logprobs

    alternative = common_pb2.TokenLogprob(text=" Paris", logprob=-0.2)
    tokens = [
        common_pb2.TokenLogprobs(text=" Lyon", logprob=-2.5, top=[alternative]),
        common_pb2.TokenLogprobs(text=" Paris", logprob=-0.2, top=[alternative]),
        common_pb2.TokenLogprobs(text=".", logprob=-0.1),  # logprobs: 0, no alternatives
    ]
    expected = [{" Paris": -0.2, " Lyon": -2.5}, {" Paris": -0.2}, {".": -0.1}]
    got = text_logprobs(tokens)["top_logprobs"]
    assert [set(t) for t in got] == [set(t) for t in expected]
    assert all(t[k] == pytest.approx(e[k]) for t, e in zip(got, expected, strict=True) for k in e)


def test_a_required_calls_arguments_are_the_models_own_json_text() -> None:
    """Parsed and written again, 1e400 became Infinity (no strict JSON reader takes it), 1E2 100.0."""
    required = ToolMode(None)
    call = required.call('{"name": "area", "arguments": {"x": 1e400, "y": 1E2, "z": 0.10}}', "call_1")
    assert call is not None and call["function"] == {
        "name": "area",
        "arguments": '{"x": 1e400, "y": 1E2, "z": 0.10}',
    }
    # Whole calls only: cut short (a stop string, max_tokens) or not an object, no call.
    assert required.call('{"name": "area", "arguments": {"x": 1', "c") is None
    assert required.call('{"name": "area", "arguments": [1]}', "c") is None
    named = ToolMode("get_weather")
    assert named.call('{"city": "Paris"', "c") is None and named.call('"Paris"', "c") is None
    assert named.call('{"city": "Paris"}', "c") is not None
