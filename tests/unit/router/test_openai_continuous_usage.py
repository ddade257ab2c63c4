"""``stream_options.continuous_usage_stats`` (vLLM's extension): with ``include_usage``, every chunk
of a stream carries the request's usage so far. The stream is made from turn messages as the router's
pipeline sends them; tests/integration/test_router_openai_synthetic.py reads the same through a real
router with the OpenAI SDK."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.api.openai.choices import ChoiceStreams
from services.router.api.openai.errors import ApiError
from services.router.api.openai.framing import Framer, with_running_usage
from services.router.api.openai.params import chat_generation, completion_generation
from services.router.api.openai.streaming import sse_body


def _delta(
    text: str, ids: Sequence[int], prompt_logprobs: int = 0, prompt_tokens: int = 0
) -> router_pb2.ChatResponse:
    prompt = [common_pb2.TokenLogprobs(text="p", logprob=-1.0) for _ in range(prompt_logprobs)]
    return router_pb2.ChatResponse(
        delta=router_pb2.TokenDelta(
            text=text, token_ids=ids, prompt_logprobs=prompt, prompt_tokens=prompt_tokens
        )
    )


def _end(
    prompt: int, completion: int, reason: int = common_pb2.FINISH_REASON_LENGTH
) -> router_pb2.ChatResponse:
    usage = common_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_prompt_tokens=1)
    return router_pb2.ChatResponse(end=router_pb2.TurnEnd(finish_reason=reason, usage=usage))


async def _stream(
    framer: Framer,
    choices: Sequence[Sequence[router_pb2.ChatResponse]],
    include_usage: bool = True,
    continuous_usage: bool = True,
    seen: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """The JSON of every event of the stream of ``choices``' messages, as a client parses them."""

    async def turn(messages: Sequence[router_pb2.ChatResponse]) -> AsyncIterator[router_pb2.ChatResponse]:
        for m in messages:
            yield m

    streams = ChoiceStreams([turn(c) for c in choices])
    first = await streams.next()
    assert first is not None
    events = sse_body(
        streams,
        framer,
        first,
        include_usage,
        5,
        seen,
        continuous_usage=continuous_usage,
        with_ids=seen is not None,
    )
    body = b"".join([chunk async for chunk in events])
    await streams.close()
    data = [line.removeprefix("data: ") for line in body.decode().splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _counts(chunk: dict[str, Any]) -> tuple[int, int, int]:
    u = chunk["usage"]
    return u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]


async def test_every_chat_chunk_carries_the_usage_so_far_and_the_last_the_final_usage() -> None:
    first = _delta("Hel", [1], prompt_tokens=5)  # the replica's count comes with its first token
    chunks = await _stream(Framer("chat", "chatcmpl-1", 1, "m"), [[first, _delta("lo", [2, 3]), _end(5, 3)]])
    # The opening (role) chunk, sent before any token, two deltas (each counting its own tokens
    # and, from the first, the prompt), the finishing chunk.
    assert [_counts(c) for c in chunks[:-1]] == [(0, 0, 0), (5, 1, 6), (5, 3, 8), (5, 3, 8)]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert set(chunks[1]["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    # The last chunk is include_usage's own, unchanged: no choices, the final usage in full.
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


async def test_a_choice_whose_deltas_carry_no_prompt_count_counts_it_from_its_end() -> None:
    # A cached answer's deltas, or a replica older than TokenDelta.prompt_tokens.
    chunks = await _stream(Framer("chat", "chatcmpl-1", 1, "m"), [[_delta("Hi", [1]), _end(5, 1)]])
    assert [_counts(c) for c in chunks[:-1]] == [(0, 0, 0), (0, 1, 1), (5, 1, 6)]


async def test_with_n_choices_each_chunks_usage_is_the_whole_requests_so_far() -> None:
    # n = 2 of one prompt: the prompt counts once, the completions are summed over both choices.
    framer = Framer("text", "cmpl-1", 1, "m", per_prompt=2)
    chunks = await _stream(framer, [[_delta("a", [1]), _end(4, 1)], [_delta("b c", [2, 3]), _end(4, 2)]])
    by_choice = [(c["choices"][0]["index"], _counts(c)) for c in chunks if c["choices"]]
    assert by_choice == [(0, (0, 1, 1)), (0, (4, 1, 5)), (1, (4, 3, 7)), (1, (4, 3, 7))]
    assert _counts(chunks[-1]) == (4, 3, 7)
    # Two prompts of one choice each: both prompts count.
    two_prompts = await _stream(
        Framer("text", "cmpl-2", 1, "m"), [[_delta("a", [1]), _end(4, 1)], [_delta("b", [2]), _end(6, 1)]]
    )
    assert _counts(two_prompts[-2]) == _counts(two_prompts[-1]) == (10, 2, 12)


async def test_continuous_usage_without_include_usage_changes_nothing() -> None:
    # vLLM's rule: continuous_usage_stats needs include_usage.
    chunks = await _stream(
        Framer("chat", "chatcmpl-1", 1, "m"), [[_delta("x", [1]), _end(2, 1)]], include_usage=False
    )
    assert chunks and all("usage" not in c for c in chunks)
    # And include_usage alone keeps OpenAI's shape: null until the last chunk.
    plain = await _stream(
        Framer("chat", "chatcmpl-1", 1, "m"), [[_delta("x", [1]), _end(2, 1)]], continuous_usage=False
    )
    assert [c["usage"] for c in plain[:-1]] == [None, None, None] and plain[-1]["usage"]["total_tokens"] == 3


def test_a_templated_delta_carries_the_usage_as_a_built_one_does() -> None:
    usage = {"prompt_tokens": 0, "completion_tokens": 2, "total_tokens": 2}
    for kind in ("chat", "text"):
        framer = Framer(kind, "c-1", 1, "m")  # type: ignore[arg-type]
        for text in ("", ' "quoted" \n', "\x00llm-mesh delta text\x00"):
            templated = with_running_usage(framer.delta_json(1, text, True), usage)
            assert isinstance(templated, str)
            assert json.loads(templated) == with_running_usage(framer.delta(1, text, True), usage)


async def test_an_in_band_error_carries_no_usage() -> None:
    chunks = await _stream(
        Framer("chat", "chatcmpl-1", 1, "m"),
        [[_delta("x", [1]), _end(2, 1, common_pb2.FINISH_REASON_ERROR)]],
    )
    assert "error" in chunks[-1] and "usage" not in chunks[-1]
    assert _counts(chunks[-2]) == (0, 1, 1)


async def test_a_resumed_stream_repeats_the_usage_its_events_first_had() -> None:
    messages = [[_delta("a", [1]), _delta("b", [2]), _delta("c", [3]), _end(3, 3)]]
    whole = await _stream(Framer("chat", "chatcmpl-r", 1, "m"), messages, seen=[0])
    resumed = await _stream(Framer("chat", "chatcmpl-r", 1, "m"), messages, seen=[2])
    assert resumed == whole[2:]


async def test_an_echoed_prompt_counts_from_its_first_chunk_and_a_scored_one_has_no_completion() -> None:
    # Echo brings the prompt's logprobs, one per token, in its first delta: the prompt is known there.
    echo = await _stream(
        Framer("text", "cmpl-e", 1, "m", echo=("a b c",)),
        [[_delta(" d", [9], prompt_logprobs=3), _end(3, 1)]],
    )
    assert [_counts(c) for c in echo] == [(3, 1, 4), (3, 1, 4), (3, 1, 4)]
    # max_tokens 0 with echo: the replica's one drawn token is no answer, never counted.
    scored = await _stream(
        Framer("text", "cmpl-s", 1, "m", echo=("a b c",), score_only=True),
        [[_delta(" d", [9], prompt_logprobs=3), _end(3, 1)]],
    )
    assert [_counts(c) for c in scored] == [(3, 0, 3), (3, 0, 3), (3, 0, 3)]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.mark.parametrize(
    ("options", "continuous"),
    [
        ({"include_usage": True, "continuous_usage_stats": True}, True),
        ({"include_usage": True, "continuous_usage_stats": False}, False),
        ({"include_usage": True, "continuous_usage_stats": None}, False),
        ({"continuous_usage_stats": True}, False),
        ({"include_usage": False, "continuous_usage_stats": True}, False),
    ],
)
def test_continuous_usage_is_asked_with_both_switches(options: dict[str, Any], continuous: bool) -> None:
    assert chat_generation({**CHAT, "stream_options": options}, "r").continuous_usage is continuous
    completion = {"prompt": "hi", "stream": True, "stream_options": options}
    assert completion_generation(completion, "r").continuous_usage is continuous


@pytest.mark.parametrize("value", ["true", 1, 0, [], {}])
def test_a_continuous_usage_stats_that_is_no_boolean_is_a_400_naming_it(value: object) -> None:
    with pytest.raises(ApiError) as refused:
        chat_generation(
            {**CHAT, "stream_options": {"include_usage": True, "continuous_usage_stats": value}}, "r"
        )
    assert refused.value.status == 400 and refused.value.param == "stream_options.continuous_usage_stats"
