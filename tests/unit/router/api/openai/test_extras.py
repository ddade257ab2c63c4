"""llm-mesh's own request fields become the turn's, and SSE event ids say where a client got to."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.gen.llmmesh.v1 import common_pb2, retriever_pb2, router_pb2
from services.router.api.openai.choices import ChoiceStreams
from services.router.api.openai.errors import ApiError
from services.router.api.openai.extras import request_id_header
from services.router.api.openai.framing import Framer
from services.router.api.openai.params import chat_generation
from services.router.api.openai.streaming import event_id, parse_event_id, sse_body

USER = [{"role": "user", "content": "hi"}]


def param_of(body: dict[str, Any]) -> str | None:
    with pytest.raises(ApiError) as caught:
        chat_generation({"messages": USER, **body}, "r")
    assert caught.value.status == 400
    return caught.value.param


def test_session_rag_and_cache_reach_the_turn() -> None:
    g = chat_generation(
        {
            "messages": USER,
            "session_id": "s-1",
            "rag": {"top_k": 3, "filter": {"lang": "en"}, "min_score": 0.2, "required": True},
            "cache": {"mode": "refresh", "semantic": True, "semantic_threshold": 0.9},
        },
        "r",
    )
    (turn,) = g.turns
    assert turn.session_id == "s-1" and turn.request_id == "r"
    assert turn.rag.enabled and turn.rag.top_k == 3 and dict(turn.rag.filter) == {"lang": "en"}
    assert round(turn.rag.min_score, 3) == 0.2 and turn.rag.required
    assert turn.cache.mode == router_pb2.CACHE_MODE_REFRESH and turn.cache.semantic
    assert g.extras.any
    plain = chat_generation({"messages": USER, "rag": True, "cache": "bypass"}, "r").turns[0]
    assert plain.rag.enabled and plain.rag.top_k == 0 and plain.cache.mode == router_pb2.CACHE_MODE_BYPASS
    assert not chat_generation({"messages": USER}, "r").extras.any


def test_rag_mode_and_rerank_reach_the_search() -> None:
    (turn,) = chat_generation({"messages": USER, "rag": {"mode": "keyword", "rerank": False}}, "r").turns
    assert turn.rag.mode == retriever_pb2.SEARCH_MODE_KEYWORD
    assert turn.rag.HasField("rerank") and not turn.rag.rerank
    (plain,) = chat_generation({"messages": USER, "rag": True}, "r").turns
    assert plain.rag.mode == retriever_pb2.SEARCH_MODE_UNSPECIFIED and not plain.rag.HasField("rerank")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"rag": {"topk": 1}}, "rag.topk"),
        ({"rag": {"top_k": 21}}, "rag.top_k"),
        ({"rag": {"filter": {"a": 1}}}, "rag.filter"),
        ({"rag": "yes"}, "rag"),
        ({"rag": {"mode": "fuzzy"}}, "rag.mode"),
        ({"rag": {"rerank": "yes"}}, "rag.rerank"),
        ({"cache": {"mode": "sometimes"}}, "cache.mode"),
        ({"cache": {"semantic_threshold": 2}}, "cache.semantic_threshold"),
        ({"session_id": "has space"}, "session_id"),
        ({"session_id": "s", "n": 2}, "n"),
        ({"resumable": True}, "resumable"),  # not a stream
        ({"resumable": "yes", "stream": True}, "resumable"),
        ({"cache_salt": ""}, "cache_salt"),  # vLLM refuses an empty salt too
        ({"cache_salt": 7}, "cache_salt"),
        ({"cache_salt": "s" * 257}, "cache_salt"),
        ({"cache_salt": "\ud800"}, "cache_salt"),
    ],
)
def test_bad_extras_are_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    assert param_of(body) == param


def test_request_id_header_is_checked() -> None:
    assert request_id_header("abc-1.2:x_y") == "abc-1.2:x_y"
    assert request_id_header(None) is None
    for bad in ("", "{tag}", "a b", "x" * 121):
        with pytest.raises(ApiError) as caught:
            request_id_header(bad)
        assert caught.value.param == "x-request-id"


def test_event_ids_round_trip_and_name_the_header_when_wrong() -> None:
    assert event_id("chatcmpl-abc", [7]) == "chatcmpl-abc-7"
    assert parse_event_id("chatcmpl-abc-7", "chatcmpl-", 1) == ("abc", [7])
    assert parse_event_id(event_id("cmpl-my-id", [3, 0, 5]), "cmpl-", 3) == ("my-id", [3, 0, 5])
    for raw, choices in (
        ("chatcmpl-abc-7", 2),
        ("cmpl-abc-7", 1),
        ("chatcmpl--7", 1),
        ("7", 1),
        ("chatcmpl-a-x", 1),
    ):
        with pytest.raises(ApiError) as caught:
            parse_event_id(raw, "chatcmpl-", choices)
        assert caught.value.param == "Last-Event-ID", raw


def _messages() -> list[router_pb2.ChatResponse]:
    texts = ["Hel", "", "lo", " there"]
    out = [
        router_pb2.ChatResponse(request_id="r", seq=i + 1, delta=router_pb2.TokenDelta(text=t))
        for i, t in enumerate(texts)
    ]
    end = router_pb2.TurnEnd(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    out.append(router_pb2.ChatResponse(request_id="r", seq=len(out) + 1, end=end))
    return out


async def _replay(messages: list[router_pb2.ChatResponse]) -> AsyncIterator[router_pb2.ChatResponse]:
    for m in messages:
        yield m


async def _stream(seen: list[int] | None, with_ids: bool = True) -> list[bytes]:
    streams = ChoiceStreams([_replay(_messages())])
    framer = Framer("chat", "chatcmpl-r", 0, "m")
    first = await streams.next()
    assert first is not None
    return [chunk async for chunk in sse_body(streams, framer, first, True, 5.0, seen, with_ids=with_ids)]


async def test_a_resumed_stream_sends_exactly_the_events_after_the_last_one_seen() -> None:
    whole = await _stream(None)
    ids = [c.split(b"\n", 1)[0] for c in whole[:-1]]
    assert ids == [f"id: chatcmpl-r-{k}".encode() for k in range(1, len(whole))]  # opening … usage
    for k in range(len(whole)):
        assert await _stream([k]) == whole[k:], k


async def test_a_stream_that_cannot_be_resumed_is_data_lines_only_as_openais_and_vllms() -> None:
    """The load tools read each event as one `data:` line (`vllm bench serve`, SGLang's
    bench_serving, llmperf): an `id:` line before it failed every streamed request."""
    plain = await _stream(None, with_ids=False)
    with_ids = await _stream(None)
    assert all(chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") for chunk in plain)
    assert [chunk.split(b"\n")[1 if chunk.startswith(b"id: ") else 0] for chunk in with_ids] == [
        chunk.split(b"\n")[0] for chunk in plain
    ]


def test_openai_user_and_cache_personal_scope_the_semantic_cache() -> None:
    body = {"messages": USER, "user": "u-42", "cache": {"semantic": True, "personal": True}}
    (turn,) = chat_generation(body, "r").turns
    assert turn.cache.user == "u-42" and turn.cache.HasField("personal") and turn.cache.personal
    (shared,) = chat_generation({"messages": USER, "cache": {"semantic": True}}, "r").turns
    assert not shared.cache.HasField("personal") and shared.cache.user == ""  # detected from the text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"cache": {"semantic": True, "personal": "yes"}}, "cache.personal"),
        ({"user": 7, "cache": {"semantic": True}}, "user"),
        ({"user": "x" * 257, "cache": {"semantic": True}}, "user"),
    ],
)
def test_bad_personal_or_user_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    assert param_of(body) == param


def test_cache_salt_reaches_every_turn_and_asks_for_no_llm_mesh_field() -> None:
    g = chat_generation({"messages": USER, "n": 2, "cache_salt": "user-42"}, "r")
    assert [t.cache_salt for t in g.turns] == ["user-42", "user-42"]
    assert not g.extras.any  # nothing in the answer changes
    assert chat_generation({"messages": USER, "cache_salt": None}, "r").turns[0].cache_salt == ""
