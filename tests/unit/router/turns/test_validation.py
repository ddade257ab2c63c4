"""A turn is a conversation (messages) or a raw prompt, never both, and a raw prompt has no
session or RAG: each refusal names the field before any work is done."""

from __future__ import annotations

import pytest

from services.common import errors
from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.turns.validation import validate

USER = [common_pb2.ChatMessage(role="user", content="Hi")]


def test_a_raw_prompt_alone_is_a_valid_turn_as_are_messages_alone() -> None:
    validate(router_pb2.ChatRequest(prompt="Once upon a time"))
    validate(router_pb2.ChatRequest(messages=USER))
    # A function's result given back is a message like the others.
    validate(router_pb2.ChatRequest(messages=[*USER, common_pb2.ChatMessage(role="tool", content="42")]))
    policy = router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_REFRESH, semantic=True, semantic_threshold=1.0)
    validate(router_pb2.ChatRequest(messages=USER, cache=policy))


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (router_pb2.ChatRequest(), "messages"),
        (router_pb2.ChatRequest(prompt="x", messages=USER), "prompt"),
        (router_pb2.ChatRequest(prompt="x", session_id="s1"), "session_id"),
        (router_pb2.ChatRequest(prompt="x", rag=router_pb2.RagOptions(enabled=True)), "rag"),
        # An enum value this router does not know, and a threshold no cosine can be measured against.
        (router_pb2.ChatRequest(messages=USER, cache=router_pb2.CachePolicy(mode=99)), "cache.mode"),  # type: ignore[arg-type]
        *(
            (
                router_pb2.ChatRequest(messages=USER, cache=router_pb2.CachePolicy(semantic_threshold=t)),
                "cache.semantic_threshold",
            )
            for t in (float("nan"), 0.0, 1.5, -0.5)
        ),
        # Lists the router hashes into cache keys: their size is checked before any hashing.
        (
            router_pb2.ChatRequest(
                messages=USER, sampling=common_pb2.SamplingParams(logit_bias={i: 1.0 for i in range(301)})
            ),
            "sampling.logit_bias",
        ),
        (
            router_pb2.ChatRequest(
                messages=USER, sampling=common_pb2.SamplingParams(stop_token_ids=range(65))
            ),
            "sampling.stop_token_ids",
        ),
        (
            router_pb2.ChatRequest(
                messages=USER, sampling=common_pb2.SamplingParams(allowed_token_ids=range(16_385))
            ),
            "sampling.allowed_token_ids",
        ),
        (
            router_pb2.ChatRequest(messages=USER, sampling=common_pb2.SamplingParams(stop=["x"] * 65)),
            "sampling.stop",
        ),
        # 86 three-byte characters: 258 bytes (the limit is in bytes, as the replica's is).
        (router_pb2.ChatRequest(messages=USER, cache_salt="€" * 86), "cache_salt"),
    ],
)
def test_a_turn_that_is_neither_or_both_is_refused_naming_the_field(
    request_: router_pb2.ChatRequest, field: str
) -> None:
    with pytest.raises(errors.InvalidArgument) as refused:
        validate(request_, "request.")
    assert refused.value.field == f"request.{field}"


@pytest.mark.parametrize("session_id", ["s" * 200_000, "a{b}", "with space", "line\nbreak", "x" * 129])
def test_a_malformed_session_id_is_refused_by_the_router_itself(session_id: str) -> None:
    # Before any call to the session service: refused alike when it is down and the turn
    # would otherwise go on without history; the message stays short whatever was sent.
    with pytest.raises(errors.InvalidArgument) as refused:
        validate(router_pb2.ChatRequest(messages=USER, session_id=session_id))
    assert refused.value.field == "session_id"
    assert len(str(refused.value)) < 200


def test_a_cache_salt_of_up_to_256_bytes_passes() -> None:
    validate(router_pb2.ChatRequest(messages=USER, cache_salt="€" * 85))


def test_a_well_formed_session_id_passes() -> None:
    validate(router_pb2.ChatRequest(messages=USER, session_id="user:42.chat_7-b"))
    validate(router_pb2.ChatRequest(messages=USER, session_id="x" * 128))
