"""Filling the response caches after a turn: best effort, and only under the key the answer belongs to."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import grpc

from services.gen.llmmesh.v1 import common_pb2, inference_pb2, router_pb2
from services.router.streams.relay import RelayOutcome
from services.router.turns.cache_step import CachePlan, cache_fill, cache_lookup
from services.router.turns.semantic_step import SemanticPlan, semantic_plan
from services.router.turns.turn_end import TurnState


class Refused(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details="answer: must be at most 65536 bytes",
        )


class Caches:
    """The exact cache and the semantic cache as a turn sees them, keeping what they are given."""

    def __init__(self, semantic_refuses: bool = False) -> None:
        self.exact: dict[str, Any] = {}
        self.semantic: list[str] = []
        self.semantic_refuses = semantic_refuses

    async def put(self, tenant: str, key: str, answer: Any) -> None:
        self.exact[key] = answer

    async def store(self, tenant: str, prompt: str, model: str, *rest: Any) -> None:
        if self.semantic_refuses:
            raise Refused()
        self.semantic.append(model)


def services(caches: Caches) -> Any:
    return SimpleNamespace(exact_cache=caches, semantic_cache=caches, semantic_confidence=None)


def finished_by(model: str) -> RelayOutcome:
    done = inference_pb2.GenerationFinished(finish_reason=common_pb2.FINISH_REASON_STOP)
    return RelayOutcome(model=model, finished=done, token_ids=[1, 2])


PLAN = CachePlan("key-1", True, True, SemanticPlan("What is the capital?", "fp"), model="primary")


async def test_an_answer_from_a_fallback_model_is_not_kept_under_the_asked_models_key() -> None:
    """The key names the model the turn asked for: a fallback's answer (the first model was down)
    would have been served for it until the entry expired (an hour by default)."""
    caches = Caches()
    await cache_fill(
        services(caches),
        "t",
        PLAN,
        finished_by("fallback"),
        common_pb2.Usage(),
        "Paris.",
        TurnState("r", 0.0),
    )
    assert caches.exact == {}
    assert caches.semantic == ["fallback"]  # the semantic layer is scoped by the answering model
    await cache_fill(
        services(caches), "t", PLAN, finished_by("primary"), common_pb2.Usage(), "Paris.", TurnState("r", 0.0)
    )
    assert caches.exact["key-1"].text == "Paris."


async def test_a_cache_that_refuses_the_answer_degrades_the_turn_and_never_fails_it() -> None:
    """An answer past the semantic cache's size (64 KB: ~820 tokens of a looping greedy answer)
    was refused with INVALID_ARGUMENT, which failed the whole turn after it had streamed."""
    state = TurnState("r", 0.0)
    caches = Caches(semantic_refuses=True)
    await cache_fill(
        services(caches), "t", PLAN, finished_by("primary"), common_pb2.Usage(), "#" * 70_000, state
    )
    assert caches.exact["key-1"].text == "#" * 70_000
    assert state.degraded == [
        "semantic cache: not stored (INVALID_ARGUMENT: answer: must be at most 65536 bytes)"
    ]


async def test_an_empty_answer_is_not_offered_to_the_semantic_cache_and_the_turn_is_not_degraded() -> None:
    """An answer that ended at once (end of sequence first) is nothing to serve another question;
    the retriever refused it, and a normal turn came back flagged degraded."""
    state = TurnState("r", 0.0)
    caches = Caches(semantic_refuses=True)  # as the retriever refuses an empty answer
    await cache_fill(services(caches), "t", PLAN, finished_by("primary"), common_pb2.Usage(), "", state)
    assert state.degraded == []
    assert caches.exact["key-1"].text == ""  # the exact layer keeps it: the same request ends alike


class RefusingLookups:
    """A semantic cache whose retriever refuses the lookup with a status that is no outage."""

    async def lookup(self, *args: Any) -> None:
        raise Refused()


async def test_a_semantic_lookup_the_retriever_refuses_degrades_the_turn_and_never_fails_it() -> None:
    state = TurnState("r", 0.0)
    s = SimpleNamespace(exact_cache=None, semantic_cache=RefusingLookups(), semantic_threshold=0.7)
    request = router_pb2.ChatRequest(cache=router_pb2.CachePolicy(semantic=True))
    assert await cache_lookup(s, "t", PLAN, request, "primary", state) is None  # type: ignore[arg-type]
    assert state.degraded == [
        "semantic cache: not looked up (INVALID_ARGUMENT: answer: must be at most 65536 bytes)"
    ]


def test_a_blank_question_skips_the_semantic_cache() -> None:
    """The retriever refuses an empty text: a blank last user message with cache.semantic failed
    the whole turn with INTERNAL (a 400 naming messages over HTTP, for valid messages)."""
    s = SimpleNamespace(semantic_cache=object())
    request = router_pb2.ChatRequest(cache=router_pb2.CachePolicy(semantic=True))
    for blank in ("", "  \n\t "):
        assert semantic_plan(s, request, [("user", blank)], ()) is None  # type: ignore[arg-type]
    assert semantic_plan(s, request, [("user", "What is the capital?")], ()) is not None  # type: ignore[arg-type]
