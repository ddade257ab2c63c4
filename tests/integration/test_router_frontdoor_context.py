"""The front door's clients against the real session and retriever services: history, RAG, semantic cache."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from services.common import errors
from services.common.metadata import TENANT_KEY
from services.gen.llmmesh.v1 import (
    common_pb2,
    retriever_pb2,
    retriever_pb2_grpc,
    router_pb2,
    session_pb2,
    session_pb2_grpc,
)
from services.router.turns.context import ConversationContext, build_messages
from services.router.turns.response_cache import CachedAnswer, SemanticCache, sampling_fingerprint
from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer

HANDBOOK = (
    "# Leave policy\n\nEvery employee gets 25 days of paid vacation per year. "
    "Unused days expire at the end of March of the following year.\n"
)


@pytest.fixture(scope="module")
def dependencies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tmp = Path(tmp_path_factory.mktemp("deps"))
    redis = RedisServer(tmp / "redis").start()
    session = ServiceProcess("services.session", ["--redis-url", redis.url])
    retriever = ServiceProcess("services.retriever", ["--milvus-uri", str(tmp / "milvus.db")])
    try:
        session.start(timeout=120)
        retriever.start(timeout=300)
        yield session.address, retriever.address
    finally:
        retriever.stop()
        session.stop()
        redis.kill()


@pytest.fixture()
async def context(
    dependencies: tuple[str, str],
) -> AsyncIterator[tuple[ConversationContext, retriever_pb2_grpc.RetrieverStub]]:
    session_addr, retriever_addr = dependencies
    async with (
        grpc.aio.insecure_channel(session_addr) as sch,
        grpc.aio.insecure_channel(retriever_addr) as rch,
    ):
        retriever = retriever_pb2_grpc.RetrieverStub(rch)
        yield (
            ConversationContext(session_pb2_grpc.SessionStub(sch), retriever, timeout_s=30),  # type: ignore[arg-type]
            retriever,
        )


async def test_turns_are_saved_and_come_back_as_history_for_the_tenant_only(
    context: tuple[ConversationContext, retriever_pb2_grpc.RetrieverStub],
) -> None:
    ctx, _ = context
    first = await ctx.load_history("acme", "conv-1")
    assert first.turns == [] and first.version == 0
    v1 = await ctx.save_turn(
        "acme", "conv-1", [("user", "My name is Ada.")], "Nice to meet you, Ada.", first.version
    )
    v2 = await ctx.save_turn("acme", "conv-1", [("user", "What is my name?")], "Ada.", v1)
    assert v2 > v1 > 0
    history = await ctx.load_history("acme", "conv-1", token_budget=1000)
    assert history.turns == [
        ("user", "My name is Ada."),
        ("assistant", "Nice to meet you, Ada."),
        ("user", "What is my name?"),
        ("assistant", "Ada."),
    ]
    assert history.version == v2
    with pytest.raises(errors.Conflict):
        await ctx.save_turn("acme", "conv-1", [("user", "late writer")], "x", v1)
    # Another tenant's "conv-1" is its own (docs/session.md, Tenants): new and empty, never a
    # refusal that says acme uses the id (PERMISSION_DENIED until 2026-12-07).
    theirs = await ctx.load_history("globex", "conv-1")
    assert (theirs.exists, theirs.turns, theirs.version) == (False, [], 0)
    assert await ctx.save_turn("globex", "conv-1", [("user", "Hi.")], "Hello.", 0) == 1
    assert (await ctx.load_history("acme", "conv-1")).version == v2


async def test_retrieved_chunks_become_numbered_sources_for_the_tenant_only(
    context: tuple[ConversationContext, retriever_pb2_grpc.RetrieverStub],
) -> None:
    ctx, retriever = context

    async def upload() -> AsyncIterator[retriever_pb2.IngestRequest]:
        header = retriever_pb2.DocumentHeader(
            document_id="handbook", title="Handbook", mime_type="text/markdown"
        )
        yield retriever_pb2.IngestRequest(header=header)
        yield retriever_pb2.IngestRequest(data=HANDBOOK.encode())

    summary = await retriever.Ingest(upload(), metadata=((TENANT_KEY, "acme"),), timeout=120)
    assert summary.chunks >= 1
    rag = router_pb2.RagOptions(enabled=True, top_k=2)
    chunks = await ctx.retrieve("acme", "How many vacation days do I get?", rag)
    assert chunks and chunks[0].document_id == "handbook"
    assert await ctx.retrieve("globex", "How many vacation days do I get?", rag) == []
    prompt = build_messages("", [], chunks, [("user", "How many vacation days do I get?")])
    assert prompt[0]["role"] == "system" and "[1] Handbook" in prompt[0]["content"]
    assert "25 days of paid vacation" in prompt[0]["content"]


async def test_semantic_cache_hits_for_the_same_prompt_and_tenant(
    context: tuple[ConversationContext, retriever_pb2_grpc.RetrieverStub],
) -> None:
    _, retriever = context
    cache = SemanticCache(retriever, timeout_s=60)  # type: ignore[arg-type]
    fp = sampling_fingerprint(common_pb2.SamplingParams(temperature=0.0, max_tokens=32))
    prompt = "What is the capital of France?"
    assert await cache.lookup("acme", prompt, "smollm2", fp) is None
    await cache.store("acme", prompt, "smollm2", fp, CachedAnswer(text="Paris."))
    hit = await cache.lookup("acme", prompt, "smollm2", fp)
    assert hit is not None and hit.text == "Paris." and hit.similarity > 0.99
    assert await cache.lookup("globex", prompt, "smollm2", fp) is None
    assert await cache.lookup("acme", prompt, "smollm2", "other-sampling") is None


async def test_a_last_answer_too_long_for_the_history_budget_is_said_not_silent(
    context: tuple[ConversationContext, retriever_pb2_grpc.RetrieverStub],
) -> None:
    """The window is a suffix: one answer over the budget leaves the model none of the
    conversation. That turn is then answered without history, and says so."""
    from types import SimpleNamespace

    from services.router.turns import sources
    from services.router.turns.turn_end import TurnState

    ctx, _ = context
    version = await ctx.save_turn("acme", "conv-long", [("user", "My name is Ada.")], "Hello Ada.", 0)
    await ctx.save_turn(
        "acme", "conv-long", [("user", "Write a long story.")], "Once upon a time. " * 1000, version
    )
    state = TurnState("r", 0.0)
    request = router_pb2.ChatRequest(session_id="conv-long")
    found = await sources.history(SimpleNamespace(context=ctx), "acme", request, state)  # type: ignore[arg-type]
    assert found is not None and found.turns == [] and found.omitted_turns == 4
    assert state.degraded == [
        "history: none of the session's 4 turns fit the 2048-token history budget (its newest alone is over it)"
    ]


async def test_a_turn_read_from_a_deleted_session_is_not_saved_into_its_successor(
    context: tuple[ConversationContext, retriever_pb2_grpc.RetrieverStub],
) -> None:
    ctx, _ = context
    await ctx.save_turn("acme", "conv-aba", [("user", "I am Ada.")], "Hello Ada.", 0)
    read = await ctx.load_history("acme", "conv-aba")
    assert read.version == 1 and read.created_at_ms > 0
    # Meanwhile the conversation is deleted and another begins under its id (version 1 again).
    assert ctx.session is not None
    tenant = ((TENANT_KEY, "acme"),)
    await ctx.session.DeleteSession(session_pb2.DeleteSessionRequest(session_id="conv-aba"), metadata=tenant)
    await ctx.save_turn("acme", "conv-aba", [("user", "I am Bob.")], "Hello Bob.", 0)
    with pytest.raises(errors.Conflict, match="created again"):
        await ctx.save_turn(
            "acme",
            "conv-aba",
            [("user", "What is my name?")],
            "Ada.",
            read.version,
            created_at_ms=read.created_at_ms,
        )
    assert (await ctx.load_history("acme", "conv-aba")).turns == [
        ("user", "I am Bob."),
        ("assistant", "Hello Bob."),
    ]


async def test_a_turn_saved_after_another_of_its_conversation_is_kept_after_it(
    context: tuple[ConversationContext, retriever_pb2_grpc.RetrieverStub],
) -> None:
    """Two turns of one conversation at once (two tabs, parallel agent calls): both answers
    reached their clients, so both are in the history. The later save was dropped with only a
    `history not saved` note."""
    from types import SimpleNamespace

    from services.router.turns import sources
    from services.router.turns.turn_end import TurnState

    ctx, _ = context
    services = SimpleNamespace(context=ctx)
    await ctx.save_turn("acme", "conv-two-tabs", [("user", "I am Ada.")], "Hello Ada.", 0)
    request = router_pb2.ChatRequest(session_id="conv-two-tabs")
    states = [TurnState(f"tab-{i}", 0.0) for i in range(2)]
    for state in states:  # both read version 1
        state.session = await sources.history(services, "acme", request, state)  # type: ignore[arg-type]
    first = await sources.save_turn(services, "acme", request, [("user", "Weather?")], "Sunny.", states[0])  # type: ignore[arg-type]
    second = await sources.save_turn(services, "acme", request, [("user", "Time?")], "Noon.", states[1])  # type: ignore[arg-type]
    assert (first, second) == (2, 3) and states[1].degraded == []
    assert (await ctx.load_history("acme", "conv-two-tabs", token_budget=1000)).turns == [
        ("user", "I am Ada."),
        ("assistant", "Hello Ada."),
        ("user", "Weather?"),
        ("assistant", "Sunny."),
        ("user", "Time?"),
        ("assistant", "Noon."),
    ]
    # A conversation deleted and begun again under its id meanwhile is still not written into.
    late = TurnState("late", 0.0)
    late.session = await sources.history(services, "acme", request, late)  # type: ignore[arg-type]
    assert ctx.session is not None
    tenant = ((TENANT_KEY, "acme"),)
    await ctx.session.DeleteSession(
        session_pb2.DeleteSessionRequest(session_id="conv-two-tabs"), metadata=tenant
    )
    for turn in range(4):  # past the version the late turn read
        await ctx.save_turn("acme", "conv-two-tabs", [("user", f"Bob {turn}")], "Hi Bob.", turn)
    assert await sources.save_turn(services, "acme", request, [("user", "And me?")], "Ada.", late) == 0  # type: ignore[arg-type]
    assert late.degraded and "created again" in late.degraded[0]
    assert ("user", "And me?") not in (
        await ctx.load_history("acme", "conv-two-tabs", token_budget=1000)
    ).turns
