"""Conversation context for a turn: session history, retrieved chunks, the prompt built from both, the saved turn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from services.common import errors
from services.common.metadata import SESSION_VERSION_KEY, TENANT_KEY
from services.gen.llmmesh.v1 import retriever_pb2, router_pb2, session_pb2
from services.router.admission.breaker import CircuitBreaker

if TYPE_CHECKING:
    from services.gen.llmmesh.v1.retriever_pb2_grpc import RetrieverAsyncStub
    from services.gen.llmmesh.v1.session_pb2_grpc import SessionAsyncStub

DEFAULT_RAG_TOP_K = 4
MAX_RAG_TOP_K = 20
# Chunks less similar to the question than this (cosine, MiniLM) stay out of the prompt unless
# RagOptions.min_score says otherwise: unrelated text scores about 0-0.15 and an answering chunk
# well above 0.3 (docs/retriever.md), so weak matches stop padding prompts.
DEFAULT_RAG_MIN_SCORE = 0.2
SNIPPET_CHARS = 200
SOURCES_PREAMBLE = (
    "Answer using the numbered sources below when they are relevant, and cite them as [1], [2], …. "
    "If they do not contain the answer, say so."
)


class HasRoleAndContent(Protocol):
    role: str
    content: str


Message = tuple[str, str] | HasRoleAndContent


@dataclass(frozen=True)
class SessionHistory:
    """A session's window of turns as the router needs it."""

    session_id: str
    system_prompt: str = ""
    turns: list[tuple[str, str]] = field(default_factory=list)
    # The version to pass as expected_version when saving this turn; 0 for a new session.
    version: int = 0
    exists: bool = False
    omitted_turns: int = 0
    # When the session was created: a save checks it is still the same one.
    created_at_ms: int = 0
    # Turns the session holds, and the most it may (0: the session service did not say).
    turn_count: int = 0
    max_turns: int = 0
    # The turn's request id is already stored (a retry): its save will be a duplicate.
    holds_request: bool = False
    # The turns stored under that request id.
    request_turns: list[tuple[str, str]] = field(default_factory=list)

    def retries(self, messages: Sequence[Message]) -> bool:
        """Whether ``messages`` are what this session stored under the turn's request id (a retry,
        as the session service tells one: the same turns but the answers), not another turn."""
        return _asked(self.request_turns) == _asked(messages)

    def refuses(self, messages: Sequence[Message]) -> str | None:
        """Why saving a turn of ``messages`` and its answer would pass the session's turn limit.

        Known before the answer, so a full session costs the client no answer it cannot keep.
        """
        if not self.max_turns or self.holds_request:
            return None
        adding = saved_turn_count(messages)
        if self.turn_count + adding <= self.max_turns:
            return None
        return f"it holds {self.turn_count} turns; this turn's {adding} would exceed the limit of {self.max_turns}"

    @property
    def messages(self) -> list[tuple[str, str]]:
        """System prompt (when set) then the turns, oldest first."""
        head = [("system", self.system_prompt)] if self.system_prompt else []
        return head + self.turns


def as_pair(message: Message) -> tuple[str, str]:
    if isinstance(message, tuple):
        return message
    return (message.role, message.content)


def _asked(messages: Sequence[Message]) -> list[tuple[str, str]]:
    return [(r, c) for r, c in map(as_pair, messages) if r not in ("system", "assistant")]


def saved_turn_count(messages: Sequence[Message]) -> int:
    """The turns ``save_turn`` stores for ``messages``: all but system messages, and the answer."""
    return sum(1 for role, _ in map(as_pair, messages) if role != "system") + 1


def format_sources(chunks: Sequence[retriever_pb2.RetrievedChunk]) -> str:
    """The context block: numbered sources the answer can cite, matching the citations' order."""
    parts = [SOURCES_PREAMBLE]
    for n, chunk in enumerate(chunks, start=1):
        title = chunk.title or chunk.document_id
        where = f"{chunk.document_id}, part {chunk.position + 1}" + (
            f", page {chunk.page}" if chunk.page else ""
        )
        parts.append(f"[{n}] {title} ({where})\n{chunk.text.strip()}")
    return "\n\n".join(parts)


def build_messages(
    system_prompt: str,
    history: Sequence[Message],
    chunks: Sequence[retriever_pb2.RetrievedChunk],
    new_messages: Sequence[Message],
) -> list[dict[str, str]]:
    """The prompt: one leading system message (system prompt + sources), history, then the new turn.

    Sources go into the single leading system message because several chat
    templates refuse a system message anywhere but first. So do the new turn's own
    system messages (a client that sends its instructions with every request, as OpenAI
    clients and the Responses API's ``instructions`` do): they are this turn's system
    prompt, in place of the session's, not a system message after the history.
    """
    turns = [as_pair(m) for m in history]
    if system_prompt and turns and turns[0] == ("system", system_prompt):
        turns = turns[1:]  # history() already put the system prompt first
    new = [as_pair(m) for m in new_messages]
    instructions = [c for r, c in new if r == "system" and c]
    if instructions:
        system_prompt = "\n\n".join(instructions)
    system_parts = [p for p in (system_prompt, format_sources(chunks) if chunks else "") if p]
    messages = [{"role": "system", "content": "\n\n".join(system_parts)}] if system_parts else []
    messages += [{"role": r, "content": c} for r, c in turns]
    messages += [{"role": r, "content": c} for r, c in new if r != "system"]
    return messages


def citations_for(chunks: Sequence[retriever_pb2.RetrievedChunk]) -> list[router_pb2.Citation]:
    """TurnEnd citations for the chunks given to the model, in source-number order."""
    return [
        router_pb2.Citation(
            document_id=c.document_id,
            title=c.title,
            chunk_id=c.chunk_id,
            position=c.position,
            score=c.score,
            snippet=c.text[:SNIPPET_CHARS],
        )
        for c in chunks
    ]


def cited_documents(chunks: Sequence[retriever_pb2.RetrievedChunk]) -> list[tuple[str, int]]:
    """(document id, version) pairs, for semantic-cache entries a document update must invalidate."""
    seen: dict[str, int] = {}
    for c in chunks:
        seen[c.document_id] = max(seen.get(c.document_id, 0), c.document_version)
    return list(seen.items())


#: The longest query the retriever takes (its ``MAX_QUERY_CHARS``).
MAX_RAG_QUERY_CHARS = 8192

#: The cheapest search there is, which the retriever's breaker sends after a search timed out with no
#: other search answered meanwhile: one short query, one dense hit, no reranker, no filter. It goes
#: through the same path as a real search (embedder and Milvus), so a retriever whose searches hang
#: does not answer it, where the gRPC health check (SERVING whatever Milvus does) would.
LIVENESS_SEARCH = retriever_pb2.SearchRequest(
    query="liveness", top_k=1, mode=retriever_pb2.SEARCH_MODE_DENSE, rerank=False
)


class ConversationContext:
    """Talks to the session and retriever services for the router, each behind its own breaker.

    An outage raises ``DependencyUnavailable`` so the turn pipeline can answer
    without history/RAG (flagged degraded) unless the client required them.
    """

    def __init__(
        self,
        session: SessionAsyncStub | None,
        retriever: RetrieverAsyncStub | None,
        breakers: Mapping[str, CircuitBreaker] | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        self.session = session
        self.retriever = retriever
        breakers = breakers or {}
        self.session_breaker = breakers.get("session") or CircuitBreaker("session")
        self.retriever_breaker = breakers.get("retriever") or CircuitBreaker("retriever")
        self.timeout_s = timeout_s

    async def load_history(
        self, tenant: str, session_id: str, token_budget: int = 0, request_id: str = ""
    ) -> SessionHistory:
        """The newest turns that fit ``token_budget`` (0 = all); a session not yet created is empty.

        With ``request_id``, the history that turn's first try saw: a retry is not shown its own
        earlier exchange (the session service cuts before the turns that request stored).
        """
        session = self._need_session()
        request = session_pb2.GetSessionRequest(
            session_id=session_id, token_budget=max(0, token_budget), before_request_id=request_id
        )
        try:
            state = await self.session_breaker.call(
                lambda: session.GetSession(request, metadata=_md(tenant), timeout=self.timeout_s)
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return SessionHistory(session_id=session_id)
            raise _session_error(exc, session_id) from exc
        return SessionHistory(
            session_id=session_id,
            system_prompt=state.info.system_prompt,
            turns=[(t.role, t.content) for t in state.turns],
            version=state.info.version,
            exists=True,
            omitted_turns=state.omitted_turns,
            turn_count=state.info.turn_count,
            max_turns=state.info.max_turns,
            created_at_ms=state.info.created_at_ms,
            holds_request=state.holds_request,
            request_turns=[(t.role, t.content) for t in state.request_turns],
        )

    async def history(self, tenant: str, session_id: str, token_budget: int = 0) -> list[tuple[str, str]]:
        """(role, content) pairs, the session's system prompt first when it has one."""
        return (await self.load_history(tenant, session_id, token_budget)).messages

    async def retrieve(
        self, tenant: str, query: str, rag: router_pb2.RagOptions
    ) -> list[retriever_pb2.RetrievedChunk]:
        """The chunks to put into the prompt for ``query``, best first."""
        if rag.top_k > MAX_RAG_TOP_K:
            raise errors.InvalidArgument("rag.top_k", f"must be 0-{MAX_RAG_TOP_K}, got {rag.top_k}")
        if not query.strip():
            return []
        # The retriever searches by at most MAX_RAG_QUERY_CHARS characters: a longer message
        # (a pasted document, then its question) is searched by its end, where the question
        # is, instead of failing the whole turn with INVALID_ARGUMENT on the query.
        query = query[-MAX_RAG_QUERY_CHARS:]
        if self.retriever is None:
            raise errors.DependencyUnavailable("retriever not configured (--retriever-addr)")
        retriever = self.retriever
        request = retriever_pb2.SearchRequest(
            query=query,
            top_k=rag.top_k or DEFAULT_RAG_TOP_K,
            metadata_filter=dict(rag.filter),
            min_score=rag.min_score if rag.HasField("min_score") else DEFAULT_RAG_MIN_SCORE,
            mode=rag.mode,
            rerank=rag.rerank if rag.HasField("rerank") else None,
        )
        try:
            response = await self.retriever_breaker.call(
                lambda: retriever.Search(request, metadata=_md(tenant), timeout=self.timeout_s),
                # A search that timed out may just be heavy (rerank, a large top_k, a long query):
                # the breaker asks the cheapest search before it counts the timeout as an outage,
                # so one tenant's heavy searches cannot turn RAG off for every tenant.
                liveness_probe=lambda: retriever.Search(
                    LIVENESS_SEARCH, metadata=_md(tenant), timeout=self.timeout_s
                ),
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise errors.InvalidArgument("rag", exc.details() or "rejected by the retriever") from exc
            # Any other refusal (FAILED_PRECONDITION: an index built with another embedding
            # model, …) is the retriever's, not the client's: the turn goes on without context,
            # marked degraded, unless rag.required; it failed the whole turn before.
            raise errors.DependencyUnavailable(
                f"retriever: {exc.code().name}: {exc.details() or 'no details'}"
            ) from exc
        return list(response.chunks)

    @staticmethod
    def build_messages(
        system_prompt: str,
        history: Sequence[Message],
        chunks: Sequence[retriever_pb2.RetrievedChunk],
        new_messages: Sequence[Message],
    ) -> list[dict[str, str]]:
        return build_messages(system_prompt, history, chunks, new_messages)

    async def save_turn(
        self,
        tenant: str,
        session_id: str,
        user_messages: Sequence[Message],
        answer: str,
        expected_version: int | None,
        metadata: Mapping[str, str] | None = None,
        request_id: str = "",
        created_at_ms: int = 0,
    ) -> int:
        """Append the turn's messages and the answer; creates the session on its first turn.

        Returns the new version; ``Conflict`` when another writer got there first. Under a
        ``request_id`` the session already stored (a retried turn), nothing is stored again and
        the version is the session's as it stands.
        """
        session = self._need_session()
        if expected_version == 0:
            create = session_pb2.CreateSessionRequest(session_id=session_id)
            try:
                await self.session_breaker.call(
                    lambda: session.CreateSession(create, metadata=_md(tenant), timeout=self.timeout_s)
                )
            except grpc.aio.AioRpcError as exc:
                # Someone else created it meanwhile: the version check below decides.
                if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                    raise _session_error(exc, session_id) from exc
        # A turn's system messages are its instructions (build_messages), not conversation:
        # saved, a client that sends them with every request filled its history with copies.
        turns = [
            session_pb2.Turn(role=r, content=c, metadata=dict(metadata or {}))
            for r, c in map(as_pair, user_messages)
            if r != "system"
        ]
        turns.append(session_pb2.Turn(role="assistant", content=answer, metadata=dict(metadata or {})))
        request = session_pb2.AppendTurnsRequest(
            session_id=session_id, turns=turns, expected_version=expected_version, request_id=request_id
        )
        if created_at_ms and expected_version:
            # The conversation read, not another one created since under its id at version 0.
            request.expected_created_at_ms = created_at_ms
        try:
            response = await self.session_breaker.call(
                lambda: session.AppendTurns(request, metadata=_md(tenant), timeout=self.timeout_s)
            )
        except grpc.aio.AioRpcError as exc:
            raise _session_error(exc, session_id) from exc
        return int(response.version)

    def _need_session(self) -> SessionAsyncStub:
        if self.session is None:
            raise errors.DependencyUnavailable("session service not configured (--session-addr)")
        return self.session


def _md(tenant: str) -> tuple[tuple[str, str], ...]:
    return ((TENANT_KEY, tenant),)


def _session_error(exc: grpc.aio.AioRpcError, session_id: str) -> Exception:
    """The session service's answer as the router's own error, naming the field."""
    detail = exc.details() or exc.code().name
    code = exc.code()
    table: dict[grpc.StatusCode, Any] = {
        grpc.StatusCode.PERMISSION_DENIED: lambda: errors.PermissionDenied(
            # Not "another tenant's": ids are per tenant since 2026-12-07, so it is an older
            # session service's word for that, or an mTLS refusal; its own message says which.
            f"session_id: {session_id!r}: {detail}"
        ),
        grpc.StatusCode.INVALID_ARGUMENT: lambda: errors.InvalidArgument("session_id", detail),
        grpc.StatusCode.ABORTED: lambda: errors.Conflict(
            f"session {session_id!r} changed meanwhile: {detail}",
            # The version it is at, which a save may append after (sources.save_turn).
            trailing=_session_version(exc),
        ),
        grpc.StatusCode.NOT_FOUND: lambda: errors.NotFound(f"session_id: {session_id!r} not found"),
        # A request id the session stored with other turns (docs/session.md, Retries).
        grpc.StatusCode.ALREADY_EXISTS: lambda: errors.AlreadyExists(detail),
        grpc.StatusCode.RESOURCE_EXHAUSTED: lambda: errors.LimitExceeded(f"session {session_id!r}: {detail}"),
        grpc.StatusCode.FAILED_PRECONDITION: lambda: errors.FailedPrecondition(
            f"session {session_id!r}: {detail}"
        ),
    }
    make = table.get(code)
    return make() if make is not None else errors.DependencyUnavailable(f"session: {code.name}: {detail}")


def _session_version(exc: grpc.aio.AioRpcError) -> tuple[tuple[str, str], ...]:
    """The ``x-llmmesh-session-version`` trailer of a refused append (the version it is at now)."""
    found: list[tuple[str, str]] = []
    # grpc.aio's Metadata: (key, value) pairs (the stubs type them as the sync API's objects).
    trailing: Any = exc.trailing_metadata() or ()
    for key, value in trailing:
        if key == SESSION_VERSION_KEY:
            found.append((key, value.decode() if isinstance(value, bytes) else str(value)))
    return tuple(found)
