"""Conversation context: history windows, RAG chunks into the prompt as numbered sources, saving turns, outages."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest

from services.common import errors
from services.common.metadata import TENANT_KEY, metadata_value
from services.gen.llmmesh.v1 import (
    common_pb2,
    retriever_pb2,
    retriever_pb2_grpc,
    router_pb2,
    session_pb2,
    session_pb2_grpc,
)
from services.router.admission.breaker import CircuitBreaker
from services.router.turns.context import ConversationContext, build_messages, citations_for, cited_documents


@dataclass
class FakeStoredSession:
    owner: str
    system_prompt: str = ""
    turns: list[session_pb2.Turn] = field(default_factory=list)
    version: int = 0


class FakeSessionService(session_pb2_grpc.SessionServicer):
    """Stands in for the session service: in memory, with its tenant and version rules."""

    def __init__(self) -> None:
        self.sessions: dict[str, FakeStoredSession] = {}

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        return metadata_value(context.invocation_metadata(), TENANT_KEY) or ""

    async def _owned(self, session_id: str, context: grpc.aio.ServicerContext) -> FakeStoredSession:
        s = self.sessions.get(session_id)
        if s is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"session {session_id} not found")
        assert s is not None
        if s.owner != self._tenant(context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "another tenant's session")
        return s

    async def CreateSession(
        self, request: session_pb2.CreateSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.SessionInfo:
        if request.session_id in self.sessions:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "taken")
        self.sessions[request.session_id] = FakeStoredSession(self._tenant(context), request.system_prompt)
        return session_pb2.SessionInfo(session_id=request.session_id)

    async def GetSession(
        self, request: session_pb2.GetSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.SessionState:
        s = await self._owned(request.session_id, context)
        info = session_pb2.SessionInfo(
            session_id=request.session_id, system_prompt=s.system_prompt, version=s.version
        )
        return session_pb2.SessionState(info=info, turns=s.turns)

    async def AppendTurns(
        self, request: session_pb2.AppendTurnsRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.AppendTurnsResponse:
        s = await self._owned(request.session_id, context)
        if request.HasField("expected_version") and request.expected_version != s.version:
            await context.abort(grpc.StatusCode.ABORTED, f"version is {s.version}")
        s.turns.extend(request.turns)
        s.version += 1
        return session_pb2.AppendTurnsResponse(version=s.version)


class FakeRetrieverSearch(retriever_pb2_grpc.RetrieverServicer):
    """Stands in for the retriever's search: returns canned chunks for the caller's tenant only."""

    def __init__(self, chunks_by_tenant: dict[str, list[retriever_pb2.RetrievedChunk]]) -> None:
        self.chunks_by_tenant = chunks_by_tenant
        self.requests: list[retriever_pb2.SearchRequest] = []
        #: A status every search is refused with, when set.
        self.refuse: grpc.StatusCode | None = None

    async def Search(
        self, request: retriever_pb2.SearchRequest, context: grpc.aio.ServicerContext
    ) -> retriever_pb2.SearchResponse:
        self.requests.append(request)
        if self.refuse is not None:
            await context.abort(self.refuse, "the index was built with another embedding model")
        tenant = metadata_value(context.invocation_metadata(), TENANT_KEY) or ""
        return retriever_pb2.SearchResponse(chunks=self.chunks_by_tenant.get(tenant, [])[: request.top_k])


CHUNK = retriever_pb2.RetrievedChunk(
    chunk_id="c1",
    document_id="handbook",
    title="Employee Handbook",
    text="Vacation is 25 days per year.",
    score=0.83,
    position=2,
    document_version=3,
)


@pytest.fixture()
async def services() -> AsyncIterator[tuple[FakeSessionService, FakeRetrieverSearch, ConversationContext]]:
    session_service = FakeSessionService()
    retriever_service = FakeRetrieverSearch({"acme": [CHUNK]})
    server = grpc.aio.server()
    session_pb2_grpc.add_SessionServicer_to_server(session_service, server)
    retriever_pb2_grpc.add_RetrieverServicer_to_server(retriever_service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    context = ConversationContext(
        session_pb2_grpc.SessionStub(channel),  # type: ignore[arg-type]
        retriever_pb2_grpc.RetrieverStub(channel),  # type: ignore[arg-type]
    )
    yield session_service, retriever_service, context
    await channel.close()
    await server.stop(None)


async def test_first_turn_creates_the_session_and_history_grows(
    services: tuple[FakeSessionService, FakeRetrieverSearch, ConversationContext],
) -> None:
    _, _, context = services
    first = await context.load_history("acme", "s1")
    assert first.turns == [] and first.version == 0 and not first.exists
    version = await context.save_turn("acme", "s1", [("user", "Hi, I'm Ada.")], "Hello Ada!", first.version)
    assert version == 1
    history = await context.history("acme", "s1")
    assert history == [("user", "Hi, I'm Ada."), ("assistant", "Hello Ada!")]
    with pytest.raises(errors.Conflict, match="changed meanwhile"):
        await context.save_turn("acme", "s1", [("user", "again")], "x", expected_version=0)


async def test_a_turns_own_instructions_lead_its_prompt_and_are_not_saved_as_conversation(
    services: tuple[FakeSessionService, FakeRetrieverSearch, ConversationContext],
) -> None:
    """OpenAI clients send their system message with every request (the Responses API its
    ``instructions``): saved, each turn added a copy to the history, and built after the
    history, it was a system message mid-conversation, which several chat templates refuse."""
    _, _, context = services
    for n, question in enumerate(("Hi, I'm Ada.", "What is my name?")):
        sent = [("system", "Answer in one sentence."), ("user", question)]
        history = await context.history("acme", "s-instructions")
        prompt = build_messages("", history, [], sent)
        assert prompt[0] == {"role": "system", "content": "Answer in one sentence."}
        assert [m["role"] for m in prompt[1:]] == ["user", "assistant"] * n + ["user"]
        await context.save_turn("acme", "s-instructions", sent, f"answer {n}", n)
    assert await context.history("acme", "s-instructions") == [
        ("user", "Hi, I'm Ada."),
        ("assistant", "answer 0"),
        ("user", "What is my name?"),
        ("assistant", "answer 1"),
    ]
    # With sources, the turn's instructions come first in the one leading system message.
    with_sources = build_messages("Stored prompt.", [], [CHUNK], [("system", "Be terse."), ("user", "q")])
    assert [m["role"] for m in with_sources] == ["system", "user"]
    assert (
        with_sources[0]["content"].startswith("Be terse.\n\n")
        and "Stored prompt." not in with_sources[0]["content"]
    )


async def test_another_tenants_session_is_permission_denied(
    services: tuple[FakeSessionService, FakeRetrieverSearch, ConversationContext],
) -> None:
    session_service, _, context = services
    session_service.sessions["s2"] = FakeStoredSession(owner="globex", system_prompt="secret")
    # An older session service's refusal (ids are per tenant now): its own words, naming the field.
    with pytest.raises(errors.PermissionDenied, match="session_id: 's2': another tenant's session"):
        await context.history("acme", "s2")


async def test_retrieve_passes_options_and_only_sees_the_tenants_chunks(
    services: tuple[FakeSessionService, FakeRetrieverSearch, ConversationContext],
) -> None:
    _, retriever_service, context = services
    rag = router_pb2.RagOptions(enabled=True, filter={"team": "hr"}, min_score=0.5)
    assert await context.retrieve("acme", "how much vacation?", rag) == [CHUNK]
    sent = retriever_service.requests[-1]
    assert (
        sent.top_k == 4
        and dict(sent.metadata_filter) == {"team": "hr"}
        and sent.min_score == pytest.approx(0.5)
    )
    assert await context.retrieve("globex", "how much vacation?", rag) == []
    with pytest.raises(errors.InvalidArgument, match=r"rag.top_k: must be 0-20"):
        await context.retrieve("acme", "q", router_pb2.RagOptions(enabled=True, top_k=50))


async def test_a_retriever_refusal_that_is_not_the_clients_degrades_the_turn(
    services: tuple[FakeSessionService, FakeRetrieverSearch, ConversationContext],
) -> None:
    """FAILED_PRECONDITION (an index built with another model) failed the whole turn even when
    rag.required was false; now it is an outage the turn degrades on. A bad filter stays the
    client's INVALID_ARGUMENT."""
    _, retriever_service, context = services
    retriever_service.refuse = grpc.StatusCode.FAILED_PRECONDITION
    try:
        with pytest.raises(errors.DependencyUnavailable, match="FAILED_PRECONDITION: the index was built"):
            await context.retrieve("acme", "q", router_pb2.RagOptions(enabled=True))
        retriever_service.refuse = grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(errors.InvalidArgument):
            await context.retrieve("acme", "q", router_pb2.RagOptions(enabled=True))
    finally:
        retriever_service.refuse = None


async def test_a_message_longer_than_a_search_query_is_searched_by_its_end(
    services: tuple[FakeSessionService, FakeRetrieverSearch, ConversationContext],
) -> None:
    """A pasted document and its question: past the retriever's query limit the whole turn failed
    with INVALID_ARGUMENT on the query; now its end, where the question is, is searched."""
    from services.retriever.search import MAX_QUERY_CHARS
    from services.router.turns.context import MAX_RAG_QUERY_CHARS

    _, retriever_service, context = services
    assert MAX_RAG_QUERY_CHARS == MAX_QUERY_CHARS
    message = "Lorem ipsum dolor sit amet. " * 1000 + "How much vacation do I get?"
    assert await context.retrieve("acme", message, router_pb2.RagOptions(enabled=True)) == [CHUNK]
    sent = retriever_service.requests[-1].query
    assert len(sent) == MAX_QUERY_CHARS and sent.endswith("How much vacation do I get?")


def test_prompt_puts_sources_in_the_leading_system_message_numbered_like_citations() -> None:
    history = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello")]
    new = [common_pb2.ChatMessage(role="user", content="How much vacation?")]
    messages = build_messages("Be brief.", history, [CHUNK], new)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.")
    assert "[1] Employee Handbook (handbook, part 3)\nVacation is 25 days per year." in system
    assert messages[-1] == {"role": "user", "content": "How much vacation?"}
    assert build_messages("", [], [], [("user", "x")]) == [{"role": "user", "content": "x"}]
    citation = citations_for([CHUNK])[0]
    assert (citation.document_id, citation.position, citation.snippet) == ("handbook", 2, CHUNK.text)
    assert cited_documents([CHUNK, CHUNK]) == [("handbook", 3)]


async def test_outages_raise_dependency_unavailable_so_the_turn_can_degrade() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    try:
        context = ConversationContext(
            session_pb2_grpc.SessionStub(channel),  # type: ignore[arg-type]
            retriever_pb2_grpc.RetrieverStub(channel),  # type: ignore[arg-type]
            breakers={"session": CircuitBreaker("session", failure_threshold=1)},
            timeout_s=1,
        )
        with pytest.raises(errors.DependencyUnavailable, match="session unavailable"):
            await context.history("acme", "s1")
        with pytest.raises(errors.DependencyUnavailable, match="circuit open"):
            await context.history("acme", "s1")
        with pytest.raises(errors.DependencyUnavailable, match="retriever unavailable"):
            await context.retrieve("acme", "q", router_pb2.RagOptions(enabled=True))
    finally:
        await channel.close()
    unconfigured = ConversationContext(None, None)
    with pytest.raises(errors.DependencyUnavailable, match="--session-addr"):
        await unconfigured.history("acme", "s1")
    with pytest.raises(errors.DependencyUnavailable, match="--retriever-addr"):
        await unconfigured.retrieve("acme", "q", router_pb2.RagOptions(enabled=True))


def test_the_rag_context_keeps_the_best_ranked_chunks_that_fit_its_budget() -> None:
    """Up to 20 chunks of up to ~6 KB went into the prompt whole, past the model's context; now
    the best-ranked ones that fit (the first cut to it, if alone over), and only those are cited."""
    from services.router.turns.sources import within_context_budget

    def chunk(i: int, size: int) -> retriever_pb2.RetrievedChunk:
        return retriever_pb2.RetrievedChunk(document_id=f"d{i}", chunk_id=f"d{i}:0", text="w" * size)

    ranked = [chunk(0, 3000), chunk(1, 3000), chunk(2, 3000), chunk(3, 100)]
    assert [c.document_id for c in within_context_budget(ranked, 8192)] == ["d0", "d1"]
    (alone,) = within_context_budget([chunk(9, 20_000), chunk(1, 10)], 8192)
    assert alone.document_id == "d9" and len(alone.text) == 8192
    assert within_context_budget([], 8192) == []
