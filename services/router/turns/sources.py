"""What a turn reads and writes besides the model: history, retrieved chunks, the pin, the save.

Each source the client did not require falls back to a degraded turn (the reason goes in
the TurnEnd) rather than failing it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.common import errors
from services.common.metadata import SESSION_VERSION_KEY
from services.gen.llmmesh.v1 import retriever_pb2, router_pb2
from services.router.turns.context import ConversationContext, SessionHistory, citations_for, cited_documents
from services.router.turns.dependencies import TurnServices
from services.router.turns.turn_end import TurnState

# What the model reads of a session's past: the rest is left out, oldest first.
HISTORY_TOKEN_BUDGET = 2048
#: What the model reads of retrieved chunks, in characters (~2,000 tokens of English): the
#: best-ranked chunks that fit, at least the first (cut to it). Up to 20 chunks of up to
#: ~6 KB each went into the prompt whole, past an 8,192-token model's context.
RAG_CONTEXT_CHARS = 8192
#: Tries to save a turn after other turns of its session were saved since it read it.
SAVE_ATTEMPTS = 3


async def lookups(
    s: TurnServices,
    tenant: str,
    request: router_pb2.ChatRequest,
    new_messages: list[tuple[str, str]],
    state: TurnState,
) -> tuple[SessionHistory | None, list[retriever_pb2.RetrievedChunk], str | None]:
    """History, retrieved chunks and the session's pinned replica: none needs another, so at once."""
    if request.session_id:
        pin = s.pins.get(tenant, request.session_id)
        if request.rag.enabled:
            return await asyncio.gather(
                history(s, tenant, request, state),
                retrieve(s, tenant, request, new_messages, state),
                pin,
            )
        found, pinned = await asyncio.gather(history(s, tenant, request, state), pin)
        return found, [], pinned
    chunks = await retrieve(s, tenant, request, new_messages, state)
    return None, chunks, None


async def history(
    s: TurnServices, tenant: str, request: router_pb2.ChatRequest, state: TurnState
) -> SessionHistory | None:
    """The session's history within the budget, or None (degraded) where it cannot be had."""
    if not request.session_id:
        return None
    required = request.session_required or request.session_must_exist
    if s.context is None or s.context.session is None:
        if required:
            raise errors.FailedPrecondition("session_id: this router has no --session-addr")
        state.degraded.append("history: no session service configured")
        return None
    try:
        found = await s.context.load_history(
            tenant, request.session_id, HISTORY_TOKEN_BUDGET, request_id=state.request_id
        )
    except errors.DependencyUnavailable as exc:
        if required:
            raise
        state.degraded.append(f"history: {exc}")
        return None
    if request.session_must_exist and not found.exists:
        raise errors.NotFound(f"session_id: no session {request.session_id!r} (session_must_exist is set)")
    if found.holds_request and not found.retries(request.messages):
        # Built from the history before that id's exchange and deduplicated at the save, another
        # turn under it would be answered without the later turns and never stored.
        raise errors.AlreadyExists(
            f"request_id: {state.request_id!r} already named another turn of session "
            f"{request.session_id!r}; send a new one"
        )
    refused = found.refuses(request.messages)
    if refused is not None:
        # What the save would say after the answer (RESOURCE_EXHAUSTED), said before it.
        raise errors.LimitExceeded(f"session {request.session_id!r}: {refused}")
    if found.omitted_turns and not found.turns:
        # The window is a suffix that stops at the first turn over the budget: a long last
        # answer leaves the model none of the conversation. Said, not left silent.
        state.degraded.append(
            f"history: none of the session's {found.omitted_turns} turns fit the "
            f"{HISTORY_TOKEN_BUDGET}-token history budget (its newest alone is over it)"
        )
    state.session = found
    return found


async def retrieve(
    s: TurnServices,
    tenant: str,
    request: router_pb2.ChatRequest,
    new_messages: list[tuple[str, str]],
    state: TurnState,
) -> list[retriever_pb2.RetrievedChunk]:
    """The chunks retrieved for the last user message (their citations in ``state``), or none."""
    if not request.rag.enabled:
        return []
    if s.context is None or s.context.retriever is None:
        if request.rag.required:
            raise errors.FailedPrecondition("rag: this router has no --retriever-addr")
        state.degraded.append("rag: no retriever configured")
        return []
    query = next((c for r, c in reversed(new_messages) if r == "user"), new_messages[-1][1])
    try:
        chunks = await s.context.retrieve(tenant, query, request.rag)
    except errors.DependencyUnavailable as exc:
        if request.rag.required:
            raise
        state.degraded.append(f"rag: {exc}")
        return []
    chunks = within_context_budget(chunks)
    state.citations = citations_for(chunks)
    state.cited = cited_documents(chunks)
    return chunks


def within_context_budget(
    chunks: Sequence[retriever_pb2.RetrievedChunk], budget: int = RAG_CONTEXT_CHARS
) -> list[retriever_pb2.RetrievedChunk]:
    """The best-ranked chunks whose texts fit ``budget`` characters together, in rank order; a
    first chunk alone over it is cut to it. The citations are made from these, so they name
    exactly what the prompt holds."""
    kept: list[retriever_pb2.RetrievedChunk] = []
    used = 0
    for chunk in chunks:
        size = len(chunk.text)
        if used + size > budget:
            if not kept:
                cut = retriever_pb2.RetrievedChunk()
                cut.CopyFrom(chunk)
                cut.text = chunk.text[:budget]
                kept.append(cut)
            break
        kept.append(chunk)
        used += size
    return kept


def build_prompt(
    history: SessionHistory | None,
    chunks: list[retriever_pb2.RetrievedChunk],
    new_messages: list[tuple[str, str]],
) -> list[tuple[str, str]]:
    """The prompt's messages: system prompt, history, sources, then the request's own."""
    system_prompt = history.system_prompt if history is not None else ""
    turns = history.turns if history is not None else []
    built = ConversationContext.build_messages(system_prompt, turns, chunks, new_messages)
    return [(m["role"], m["content"]) for m in built]


async def save_turn(
    s: TurnServices,
    tenant: str,
    request: router_pb2.ChatRequest,
    new_messages: list[tuple[str, str]],
    answer: str,
    state: TurnState,
) -> int:
    """The turn appended to its session; the new version, or 0 where it was not saved."""
    if state.session is None or s.context is None:
        return 0
    expected = state.session.version if state.session.exists else 0
    created_at_ms = state.session.created_at_ms if state.session.exists else 0
    try:
        for attempt in range(1, SAVE_ATTEMPTS + 1):
            try:
                return await s.context.save_turn(
                    tenant,
                    request.session_id,
                    new_messages,
                    answer,
                    expected,
                    request_id=state.request_id,
                    created_at_ms=created_at_ms,
                )
            except errors.Conflict as conflict:
                # Another turn of this conversation was saved since this one read it (two tabs,
                # parallel agent calls). Both answers reached their clients, so both are kept:
                # this turn goes after the other. It was dropped before, with only a note.
                # The conversation read must still be the one there: with its creation time
                # kept, a session deleted and created again under its id refuses every try.
                moved_to = _version_now(conflict)
                if attempt == SAVE_ATTEMPTS or moved_to is None or moved_to <= expected:
                    raise
                expected = moved_to
        raise AssertionError("unreachable")  # the loop returns or raises
    except (errors.DependencyUnavailable, errors.Conflict) as exc:
        # The answer already reached the client; losing the save is reported, not fatal.
        # session_must_exist implies session_required (router.proto), at save time as at read.
        required = request.session_required or request.session_must_exist
        if required and isinstance(exc, errors.DependencyUnavailable):
            raise
        state.degraded.append(f"history not saved: {exc}")
        return 0


def _version_now(conflict: errors.Conflict) -> int | None:
    """The version the session service said the session is at, when it said one."""
    for key, value in conflict.trailing:
        if key == SESSION_VERSION_KEY and value.isdigit():
            return int(value)
    return None
