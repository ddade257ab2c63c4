"""The turn pipeline: admission → history → RAG → cache → pick replica → relay → save → fill cache.

One authenticated turn in, a stream of ChatResponse out (tokens, then one
TurnEnd), each numbered ``(request_id, seq)``. Chat, ChatStream, Complete and
async tasks all run turns through here.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from services.common import errors, tracing
from services.gen.llmmesh.v1 import common_pb2, inference_pb2, retriever_pb2, router_pb2
from services.router import metrics
from services.router.admission.auth import Principal
from services.router.admission.ratelimit import InflightLimiter, RateLimiter
from services.router.placement.models import ModelCatalog
from services.router.placement.pins import AffinityPins
from services.router.placement.pool import ReplicaPool
from services.router.streams.relay import Relay, RelayOutcome
from services.router.streams.replay import ReplayBuffer
from services.router.streams.replay_writer import ReplayWriter
from services.router.turns.context import ConversationContext, SessionHistory, citations_for
from services.router.turns.response_cache import (
    CachedAnswer,
    ExactCache,
    SemanticCache,
    exact_cache_key,
    sampling_fingerprint,
)

log = logging.getLogger("llmmesh.router.turn")

ROLES = frozenset({"system", "user", "assistant"})
# What the model reads of a session's past: the rest is left out, oldest first.
HISTORY_TOKEN_BUDGET = 2048
DEGRADED_ANSWER = "The service is busy and cannot answer right now; please try again shortly."
# A turn that finds no model known while replicas await their first health check waits this
# long at most (and never past its deadline) before UNAVAILABLE.
STARTUP_WAIT_S = 5.0


@dataclass
class TurnServices:
    """Everything a turn may use; the optional ones are off when not configured."""

    pool: ReplicaPool
    relay: Relay
    catalog: ModelCatalog
    pins: AffinityPins
    rate_limiter: RateLimiter | None = None
    inflight: InflightLimiter | None = None
    exact_cache: ExactCache | None = None
    semantic_cache: SemanticCache | None = None
    context: ConversationContext | None = None
    replay: ReplayBuffer | None = None
    #: Told where each session's turn ran, to move and pre-warm sessions off a lost replica.
    on_session_served: Callable[[str, str, str], None] | None = None
    clock: Callable[[], float] = time.monotonic


def validate(request: router_pb2.ChatRequest, field_prefix: str = "") -> None:
    """Reject bad input with a message naming the field (after ``field_prefix``), before any work is done."""
    if not request.messages:
        raise errors.InvalidArgument(f"{field_prefix}messages", "at least one message is required")
    for i, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise errors.InvalidArgument(
                f"{field_prefix}messages[{i}].role",
                f"must be one of system, user, assistant; got {message.role!r}",
            )
    if len(request.request_id) > 128:
        raise errors.InvalidArgument(f"{field_prefix}request_id", "must be at most 128 characters")
    if request.rag.enabled and request.rag.top_k > 20:
        raise errors.InvalidArgument(f"{field_prefix}rag.top_k", f"must be in 0..20, got {request.rag.top_k}")


def token_message(
    request_id: str, seq: int, batch: list[inference_pb2.TokenChunk]
) -> router_pb2.ChatResponse:
    """One ChatResponse whose TokenDelta carries consecutive chunks, filled in place (no copy of a delta)."""
    response = router_pb2.ChatResponse(request_id=request_id, seq=seq)
    delta = response.delta
    first = batch[0]
    delta.index = first.index
    if len(batch) == 1:
        delta.text = first.text
        delta.token_ids.extend(first.token_ids)
    else:
        delta.text = "".join(c.text for c in batch)
        for c in batch:
            delta.token_ids.extend(c.token_ids)
    return response


@dataclass
class TurnState:
    """Bookkeeping of one turn while it runs."""

    request_id: str
    started: float
    seq: int = 0
    degraded: list[str] = field(default_factory=list)
    citations: list[router_pb2.Citation] = field(default_factory=list)
    session: SessionHistory | None = None
    #: The TurnEnd was made: nothing follows it, not even a CANCELLED one.
    ended: bool = False
    #: The relay's bookkeeping, once the turn asks a replica (model, retries, failovers).
    outcome: RelayOutcome | None = None
    #: Answer tokens sent to the client so far (a resumed task's delivered ones included), and
    #: the replica that made the last of them: a turn that stops early reports these.
    streamed: int = 0
    streamed_by: str = ""


def turn_usage(finished: inference_pb2.GenerationFinished | None, completion_tokens: int) -> common_pb2.Usage:
    """A turn's usage: what the client received, the prompt once.

    ``completion_tokens`` is every answer token the client got, across failovers (a replica
    counts only what it generated itself, not the tokens it resumed after). Every attempt
    reads the same prompt, so the prompt is counted once, with ``cached_prompt_tokens``, from
    the attempt that finished (capped at the prompt: its prefix cache may also hold resumed
    tokens, which are answer, not prompt). Failed and cancelled attempts report nothing, so
    a turn no attempt finished has prompt_tokens 0: unknown, never guessed.
    """
    usage = common_pb2.Usage(completion_tokens=completion_tokens)
    if finished is not None:
        usage.prompt_tokens = finished.usage.prompt_tokens
        usage.cached_prompt_tokens = min(finished.usage.cached_prompt_tokens, usage.prompt_tokens)
    return usage


@dataclass(frozen=True)
class TurnCheckpoint:
    """What a turn decided before its first token, so another router can finish its answer.

    The prompt as built (history and retrieved chunks included), the model that
    answers, the session version the answer will be saved against, and what
    goes into the TurnEnd besides the answer. Resuming with the tokens already
    delivered (``ResumePoint``) continues exactly where the answer stopped:
    the same prompt, the same model, ``resume_token_ids``.
    """

    start: bytes
    model: str
    session_id: str = ""
    session_exists: bool = False
    session_version: int = 0
    citations: tuple[bytes, ...] = ()
    degraded: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(
            {
                "start": base64.b64encode(self.start).decode(),
                "model": self.model,
                "session_id": self.session_id,
                "session_exists": self.session_exists,
                "session_version": self.session_version,
                "citations": [base64.b64encode(c).decode() for c in self.citations],
                "degraded": list(self.degraded),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> TurnCheckpoint:
        raw = json.loads(text)
        return cls(
            start=base64.b64decode(raw["start"]),
            model=raw["model"],
            session_id=raw.get("session_id", ""),
            session_exists=bool(raw.get("session_exists", False)),
            session_version=int(raw.get("session_version", 0)),
            citations=tuple(base64.b64decode(c) for c in raw.get("citations", [])),
            degraded=tuple(raw.get("degraded", [])),
        )


@dataclass(frozen=True)
class ResumePoint:
    """A turn to finish: its checkpoint and the answer delivered so far."""

    checkpoint: TurnCheckpoint
    token_ids: tuple[int, ...]
    text: str


#: Called once per turn, before its first token goes out, with the turn's checkpoint.
OnCheckpoint = Callable[[TurnCheckpoint], Awaitable[None]]
#: Called with the TurnEnd (CANCELLED or ERROR) of a turn that stopped before sending its own.
OnStopped = Callable[[router_pb2.ChatResponse], None]


class TurnPipeline:
    """Runs turns; ``run_turn`` is what every RPC and the task worker call."""

    def __init__(self, services: TurnServices) -> None:
        self.s = services
        # Bookkeeping tasks still running (asyncio keeps only weak references to tasks).
        self._pending: set[asyncio.Future[Any]] = set()

    async def run_turn(
        self,
        principal: Principal,
        request: router_pb2.ChatRequest,
        deadline: float | None = None,
        *,
        resume: ResumePoint | None = None,
        on_checkpoint: OnCheckpoint | None = None,
        on_stopped: OnStopped | None = None,
    ) -> AsyncGenerator[router_pb2.ChatResponse, None]:
        """The turn's messages: token deltas, then one TurnEnd. ``deadline`` is on ``services.clock``.

        ``on_checkpoint`` (async tasks) is awaited before the first token goes out; ``resume``
        finishes a turn from its checkpoint, after the tokens already delivered. A turn
        cancelled or failed before its TurnEnd cannot yield one: ``on_stopped`` is given the
        TurnEnd it would have sent (CANCELLED or ERROR, with the usage of what was streamed).
        """
        validate(request)
        s = self.s
        state = TurnState(request.request_id or uuid.uuid4().hex, s.clock())
        writer = ReplayWriter(s.replay, state.request_id, principal.tenant) if s.replay is not None else None
        # The message being written to the client: it goes to the replay buffer once that
        # write is done (the caller asks for the next one), so the buffer's Redis round trip
        # never competes with the client's own hop for the CPU (measured: +0.3-0.7 ms per
        # paced message on an idle 2-vCPU box when the buffer wrote first).
        unbuffered: router_pb2.ChatResponse | None = None
        metrics.IN_FLIGHT.inc()
        slot = s.inflight.slot() if s.inflight is not None else contextlib.nullcontext()
        try:
            with slot:
                async for response in self._turn(principal, request, deadline, state, resume, on_checkpoint):
                    unbuffered = response
                    yield response
                    unbuffered = None
                    if writer is not None:
                        writer.put(response)
                        if state.ended:
                            writer.end()  # the TurnEnd and the end marker go to Redis in one write
        except (asyncio.CancelledError, GeneratorExit):
            # The client cancelled or went away: a Resume must still learn how the turn ended,
            # with the same TurnEnd Chat sends (next seq, CANCELLED), before the buffer finishes.
            # The message in flight counts as streamed: Resume sends it, so its usage includes it.
            self._stop(state, request, writer, unbuffered, on_stopped, common_pb2.FINISH_REASON_CANCELLED)
            raise
        except Exception as exc:
            # The client gets a gRPC status; the replay buffer gets an ERROR TurnEnd saying why.
            self._stop(
                state, request, writer, unbuffered, on_stopped, common_pb2.FINISH_REASON_ERROR, str(exc)
            )
            raise
        finally:
            metrics.IN_FLIGHT.dec()
            if writer is not None:
                await writer.close()

    def _stop(
        self,
        state: TurnState,
        request: router_pb2.ChatRequest,
        writer: ReplayWriter | None,
        unbuffered: router_pb2.ChatResponse | None,
        on_stopped: OnStopped | None,
        reason: int,
        error: str = "",
    ) -> None:
        """A turn stopped before its TurnEnd: the replay buffer and ``on_stopped`` get the one it did not send."""
        if writer is not None and unbuffered is not None:
            writer.put(unbuffered)  # it may not have reached the client: Resume sends it
        if state.ended:
            return
        stopped = self._stopped(state, request, reason, error)
        if writer is not None:
            writer.put(stopped)
        if on_stopped is not None:
            on_stopped(stopped)

    def _stopped(
        self, state: TurnState, request: router_pb2.ChatRequest, reason: int, error: str = ""
    ) -> router_pb2.ChatResponse:
        """The TurnEnd of a turn that did not end by itself (cancelled, or failed with a status).

        Its usage is the tokens streamed before it stopped, and its replica the one that made them.
        """
        state.ended = True
        outcome = state.outcome or RelayOutcome()
        timings = common_pb2.Timings(total_ms=(self.s.clock() - state.started) * 1000)
        if outcome.first_token_at is not None:
            timings.ttft_ms = (outcome.first_token_at - state.started) * 1000
        return self._message(
            state,
            end=router_pb2.TurnEnd(
                finish_reason=reason,  # type: ignore[arg-type]
                usage=turn_usage(None, state.streamed),
                timings=timings,
                replica=state.streamed_by,
                model=outcome.model,
                retries=outcome.retries,
                failovers=outcome.failovers,
                degraded=bool(state.degraded),
                degraded_reasons=state.degraded,
                citations=state.citations,
                session_id=request.session_id,
                error_message=error,
            ),
        )

    def _message(self, state: TurnState, **event: Any) -> router_pb2.ChatResponse:
        state.seq += 1
        return router_pb2.ChatResponse(request_id=state.request_id, seq=state.seq, **event)

    async def _turn(
        self,
        principal: Principal,
        request: router_pb2.ChatRequest,
        deadline: float | None,
        state: TurnState,
        resume: ResumePoint | None = None,
        on_checkpoint: OnCheckpoint | None = None,
    ) -> AsyncIterator[router_pb2.ChatResponse]:
        s = self.s
        tenant = principal.tenant
        if s.rate_limiter is not None and resume is None:
            # A resumed task's turn was admitted when it first ran: a dead router's takeover does
            # not spend another of the key's requests.
            await s.rate_limiter.admit_request(principal)
        new_messages = [(m.role, m.content) for m in request.messages]
        pinned: str | None = None
        if resume is not None:
            # The prompt, model and session version were settled before the first token: looking
            # them up again could give another prompt, which the delivered tokens do not continue.
            start = self._resumed(resume, state)
            models = [resume.checkpoint.model]
            messages = [(m.role, m.content) for m in start.messages]
        else:
            known = s.pool.models()
            if not known and s.pool.discovering():
                # The router (or every replica) is new: the first health checks are moments away.
                wait_s = STARTUP_WAIT_S if deadline is None else min(STARTUP_WAIT_S, deadline - s.clock())
                known = await s.pool.wait_for_models(wait_s)
            try:
                models = s.catalog.plan(request.model, known)
            except errors.DependencyUnavailable as exc:
                if not request.allow_degraded:
                    raise
                async for response in self._degraded(principal, request, None, str(exc), state):
                    yield response
                return
            prompt: Iterable[common_pb2.ChatMessage]
            if request.session_id or request.rag.enabled:
                history, chunks, pinned = await self._lookups(tenant, request, new_messages, state)
                messages = self._build(history, chunks, new_messages)
                prompt = [common_pb2.ChatMessage(role=r, content=c) for r, c in messages]
            else:
                # No history, no sources: the prompt is the request's messages, copied as they are.
                messages, prompt = new_messages, request.messages
            start = inference_pb2.GenerateStart(
                request_id=state.request_id, messages=prompt, sampling=request.sampling
            )
        cache_mode = request.cache.mode
        caching = s.exact_cache is not None or (request.cache.semantic and s.semantic_cache is not None)
        key = exact_cache_key(models[0], messages, request.sampling) if caching else None
        may_read = resume is None and cache_mode in (
            router_pb2.CACHE_MODE_UNSPECIFIED,
            router_pb2.CACHE_MODE_DEFAULT,
        )
        may_fill = cache_mode != router_pb2.CACHE_MODE_BYPASS

        if may_read:
            hit = await self._cache_lookup(tenant, key, request, models[0], messages, state)
            if hit is not None:
                cached, layer = hit
                metrics.CACHE_HITS.labels(
                    layer="exact" if layer == router_pb2.CACHE_LAYER_EXACT else "semantic"
                ).inc()
                async for response in self._replay_answer(principal, request, cached, layer, state):
                    yield response
                return

        session_key = f"{tenant}:{request.session_id}" if request.session_id else None
        outcome = state.outcome = RelayOutcome()
        if resume is not None:
            # The relay continues an answer that has tokens exactly as it fails over mid-stream.
            outcome.model = resume.checkpoint.model
            outcome.token_ids.extend(resume.token_ids)
            outcome.text_parts.append(resume.text)
            state.streamed = len(resume.token_ids)  # delivered by an earlier attempt: the client has them
        clock = s.clock
        request_id = state.request_id
        previous_at: float | None = None
        try:
            relayed = s.relay.generate(start, models, outcome, deadline, session_key, pinned)
            # The per-message path: one clock read, one histogram sample, one proto built in place.
            async for batch in relayed:
                now = clock()
                if previous_at is None:
                    metrics.TTFT.observe(now - state.started)
                    if on_checkpoint is not None and resume is None:
                        await on_checkpoint(self._checkpoint(start, outcome, request, state))
                else:
                    metrics.INTER_TOKEN.observe(now - previous_at)
                previous_at = now
                state.seq += 1
                # The relay has added this batch to the answer, and nothing it has not yet sent.
                state.streamed = len(outcome.token_ids)
                state.streamed_by = outcome.replica
                yield token_message(request_id, state.seq, batch)
        except errors.DependencyUnavailable as exc:
            if outcome.token_ids:
                # Tokens already reached the client: end the turn in-band rather than break the stream.
                yield self._end(state, request, outcome, error=str(exc))
                return
            if not request.allow_degraded:
                raise
            async for response in self._degraded(principal, request, key, str(exc), state):
                yield response
            return

        if request.session_id and outcome.replica and s.on_session_served is not None:
            s.on_session_served(outcome.replica, tenant, request.session_id)
        # The pin and the token charge change nothing in the TurnEnd: they are written while it goes
        # out, and the turn (so the call) ends only once they landed.
        usage = turn_usage(outcome.finished, len(outcome.token_ids))
        bookkeeping = self._bookkeeping(principal, request, outcome, usage, pinned)
        answer = "".join(outcome.text_parts)
        finished = outcome.finished
        complete = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        fill = may_fill and key is not None and finished is not None and finished.finish_reason in complete
        if fill and state.session is not None:
            # The session version and cache-fill errors are in the TurnEnd: both before it, at once.
            version, _ = await asyncio.gather(
                self._save(tenant, request, new_messages, answer, state),
                self._cache_fill(tenant, key, request, outcome, usage, answer, messages, state),
            )
        else:
            # Nothing to wait for on a turn without session or cache: its TurnEnd goes out at once.
            version = 0
            if state.session is not None:
                version = await self._save(tenant, request, new_messages, answer, state)
            if fill:
                await self._cache_fill(tenant, key, request, outcome, usage, answer, messages, state)
        if finished is not None:
            metrics.PROMPT_TOKENS.inc(finished.usage.prompt_tokens)
        metrics.COMPLETION_TOKENS.inc(len(outcome.token_ids))
        yield self._end(state, request, outcome, version=version)
        if bookkeeping is not None:
            await asyncio.shield(bookkeeping)  # a cancel here must not cancel the writes

    def _checkpoint(
        self,
        start: inference_pb2.GenerateStart,
        outcome: RelayOutcome,
        request: router_pb2.ChatRequest,
        state: TurnState,
    ) -> TurnCheckpoint:
        session = state.session
        return TurnCheckpoint(
            start=start.SerializeToString(),
            model=outcome.model,
            session_id=request.session_id if session is not None else "",
            session_exists=session.exists if session is not None else False,
            session_version=session.version if session is not None else 0,
            citations=tuple(c.SerializeToString() for c in state.citations),
            degraded=tuple(state.degraded),
        )

    def _resumed(self, resume: ResumePoint, state: TurnState) -> inference_pb2.GenerateStart:
        """The checkpoint's prompt, and its session version, citations and degradations in ``state``."""
        checkpoint = resume.checkpoint
        start = inference_pb2.GenerateStart.FromString(checkpoint.start)
        start.request_id = state.request_id
        if checkpoint.session_id:
            state.session = SessionHistory(
                checkpoint.session_id, version=checkpoint.session_version, exists=checkpoint.session_exists
            )
        state.citations = [router_pb2.Citation.FromString(c) for c in checkpoint.citations]
        state.degraded = list(checkpoint.degraded)
        return start

    async def _lookups(
        self,
        tenant: str,
        request: router_pb2.ChatRequest,
        new_messages: list[tuple[str, str]],
        state: TurnState,
    ) -> tuple[SessionHistory | None, list[retriever_pb2.RetrievedChunk], str | None]:
        """History, retrieved chunks and the session's pinned replica: none needs another, so at once."""
        if request.session_id:
            pin = self.s.pins.get(tenant, request.session_id)
            if request.rag.enabled:
                return await asyncio.gather(
                    self._history(tenant, request, state),
                    self._retrieve(tenant, request, new_messages, state),
                    pin,
                )
            history, pinned = await asyncio.gather(self._history(tenant, request, state), pin)
            return history, [], pinned
        chunks = await self._retrieve(tenant, request, new_messages, state)
        return None, chunks, None

    def _bookkeeping(
        self,
        principal: Principal,
        request: router_pb2.ChatRequest,
        outcome: RelayOutcome,
        usage: common_pb2.Usage,
        pinned: str | None,
    ) -> asyncio.Future[Any] | None:
        """The session's pin and the answer's token charge, written in a task of their own.

        A task, so a client that leaves as soon as it has its TurnEnd is still charged in full.
        """
        s = self.s
        writes: list[Awaitable[None]] = []
        if request.session_id and outcome.replica and outcome.replica != pinned:
            writes.append(s.pins.set(principal.tenant, request.session_id, outcome.replica))
        finished = outcome.finished
        if s.rate_limiter is not None and finished is not None and s.rate_limiter.counts_tokens(principal):
            # The whole answer's tokens, every replica's part of a failed-over one included.
            used = usage.prompt_tokens + usage.completion_tokens
            writes.append(s.rate_limiter.record_tokens(principal, used))
        if not writes:
            return None
        task = asyncio.ensure_future(asyncio.gather(*writes))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def _history(
        self, tenant: str, request: router_pb2.ChatRequest, state: TurnState
    ) -> SessionHistory | None:
        if not request.session_id:
            return None
        if self.s.context is None or self.s.context.session is None:
            if request.session_required:
                raise errors.FailedPrecondition("session_id: this router has no --session-addr")
            state.degraded.append("history: no session service configured")
            return None
        try:
            found = await self.s.context.load_history(tenant, request.session_id, HISTORY_TOKEN_BUDGET)
        except errors.DependencyUnavailable as exc:
            if request.session_required:
                raise
            state.degraded.append(f"history: {exc}")
            return None
        state.session = found
        return found

    async def _retrieve(
        self,
        tenant: str,
        request: router_pb2.ChatRequest,
        new_messages: list[tuple[str, str]],
        state: TurnState,
    ) -> list[retriever_pb2.RetrievedChunk]:
        if not request.rag.enabled:
            return []
        if self.s.context is None or self.s.context.retriever is None:
            if request.rag.required:
                raise errors.FailedPrecondition("rag: this router has no --retriever-addr")
            state.degraded.append("rag: no retriever configured")
            return []
        query = next((c for r, c in reversed(new_messages) if r == "user"), new_messages[-1][1])
        try:
            chunks = await self.s.context.retrieve(tenant, query, request.rag)
        except errors.DependencyUnavailable as exc:
            if request.rag.required:
                raise
            state.degraded.append(f"rag: {exc}")
            return []
        state.citations = citations_for(chunks)
        return list(chunks)

    def _build(
        self,
        history: SessionHistory | None,
        chunks: list[retriever_pb2.RetrievedChunk],
        new_messages: list[tuple[str, str]],
    ) -> list[tuple[str, str]]:
        system_prompt = history.system_prompt if history is not None else ""
        turns = history.turns if history is not None else []
        built = ConversationContext.build_messages(system_prompt, turns, chunks, new_messages)
        return [(m["role"], m["content"]) for m in built]

    async def _cache_lookup(
        self,
        tenant: str,
        key: str | None,
        request: router_pb2.ChatRequest,
        model: str,
        messages: list[tuple[str, str]],
        state: TurnState,
    ) -> tuple[CachedAnswer, int] | None:
        s = self.s
        if key is not None and s.exact_cache is not None:
            try:
                with tracing.stage("exact cache lookup"):
                    hit = await s.exact_cache.get(tenant, key)
            except errors.DependencyUnavailable as exc:
                state.degraded.append(f"exact cache: {exc}")
            else:
                if hit is not None:
                    return hit, router_pb2.CACHE_LAYER_EXACT
        if request.cache.semantic and key is not None and s.semantic_cache is not None:
            threshold = (
                request.cache.semantic_threshold if request.cache.HasField("semantic_threshold") else None
            )
            try:
                hit = await s.semantic_cache.lookup(
                    tenant, messages[-1][1], model, sampling_fingerprint(request.sampling), threshold
                )
            except errors.DependencyUnavailable as exc:
                state.degraded.append(f"semantic cache: {exc}")
            else:
                if hit is not None:
                    return hit, router_pb2.CACHE_LAYER_SEMANTIC
        return None

    async def _cache_fill(
        self,
        tenant: str,
        key: str | None,
        request: router_pb2.ChatRequest,
        outcome: RelayOutcome,
        usage: common_pb2.Usage,
        answer: str,
        messages: list[tuple[str, str]],
        state: TurnState,
    ) -> None:
        s = self.s
        if key is None or outcome.finished is None:
            return
        # The turn's usage, as its TurnEnd says: a hit replays it (not the last replica's part).
        cached = CachedAnswer(
            text=answer,
            token_ids=list(outcome.token_ids),
            model=outcome.model,
            finish_reason=outcome.finished.finish_reason,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_prompt_tokens=usage.cached_prompt_tokens,
            created_at_ms=int(time.time() * 1000),
        )
        if s.exact_cache is not None:
            try:
                await s.exact_cache.put(tenant, key, cached)
            except errors.DependencyUnavailable as exc:
                state.degraded.append(f"exact cache: {exc}")
        if request.cache.semantic and s.semantic_cache is not None:
            try:
                await s.semantic_cache.store(
                    tenant, messages[-1][1], outcome.model, sampling_fingerprint(request.sampling), cached
                )
            except errors.DependencyUnavailable as exc:
                state.degraded.append(f"semantic cache: {exc}")

    async def _save(
        self,
        tenant: str,
        request: router_pb2.ChatRequest,
        new_messages: list[tuple[str, str]],
        answer: str,
        state: TurnState,
    ) -> int:
        if state.session is None or self.s.context is None:
            return 0
        expected = state.session.version if state.session.exists else 0
        try:
            return await self.s.context.save_turn(tenant, request.session_id, new_messages, answer, expected)
        except (errors.DependencyUnavailable, errors.Conflict) as exc:
            # The answer already reached the client; losing the save is reported, not fatal.
            if request.session_required and isinstance(exc, errors.DependencyUnavailable):
                raise
            state.degraded.append(f"history not saved: {exc}")
            return 0

    async def _replay_answer(
        self,
        principal: Principal,
        request: router_pb2.ChatRequest,
        answer: CachedAnswer,
        layer: int,
        state: TurnState,
        degraded_reason: str | None = None,
    ) -> AsyncIterator[router_pb2.ChatResponse]:
        """A stored answer streamed like a live one: one delta, then the TurnEnd."""
        if answer.text or answer.token_ids:
            state.streamed = len(answer.token_ids)
            yield self._message(
                state, delta=router_pb2.TokenDelta(text=answer.text, token_ids=answer.token_ids, index=0)
            )
        if degraded_reason:
            state.degraded.append(degraded_reason)
        version = 0
        if degraded_reason is None:
            new_messages = [(m.role, m.content) for m in request.messages]
            version = await self._save(principal.tenant, request, new_messages, answer.text, state)
        outcome = RelayOutcome(model=answer.model)
        end = self._end(state, request, outcome, version=version)
        end.end.cache_layer = layer  # type: ignore[assignment]
        end.end.finish_reason = answer.finish_reason  # type: ignore[assignment]
        # The original answer's usage, as it was first reported.
        end.end.usage.prompt_tokens = answer.prompt_tokens
        end.end.usage.completion_tokens = answer.completion_tokens
        end.end.usage.cached_prompt_tokens = answer.cached_prompt_tokens
        yield end

    async def _degraded(
        self,
        principal: Principal,
        request: router_pb2.ChatRequest,
        key: str | None,
        reason: str,
        state: TurnState,
    ) -> AsyncIterator[router_pb2.ChatResponse]:
        """No replica can serve and the client allowed it: a stale cached answer or a fixed reply."""
        stale: CachedAnswer | None = None
        if key is not None and self.s.exact_cache is not None:
            with contextlib.suppress(errors.DependencyUnavailable):
                stale = await self.s.exact_cache.get(principal.tenant, key)
        layer = router_pb2.CACHE_LAYER_EXACT if stale is not None else router_pb2.CACHE_LAYER_UNSPECIFIED
        answer = stale or CachedAnswer(text=DEGRADED_ANSWER, finish_reason=common_pb2.FINISH_REASON_STOP)
        async for response in self._replay_answer(
            principal, request, answer, layer, state, degraded_reason=f"fallback answer: {reason}"
        ):
            yield response

    def _end(
        self,
        state: TurnState,
        request: router_pb2.ChatRequest,
        outcome: RelayOutcome,
        version: int = 0,
        error: str = "",
    ) -> router_pb2.ChatResponse:
        """The turn's last message."""
        state.ended = True
        now = self.s.clock()
        finished = outcome.finished
        timings = common_pb2.Timings()
        reason = common_pb2.FINISH_REASON_ERROR if error else common_pb2.FINISH_REASON_STOP
        # The replica that made the last token: the one that finished, else (the turn gave up
        # mid-answer) the last that streamed, not the last one tried.
        replica = outcome.replica
        if finished is not None:
            timings.CopyFrom(finished.timings)
            reason = finished.finish_reason
        elif outcome.token_ids:
            replica = state.streamed_by
        timings.total_ms = (now - state.started) * 1000
        if outcome.first_token_at is not None:
            timings.ttft_ms = (outcome.first_token_at - state.started) * 1000
        metrics.E2E.observe(now - state.started)
        return self._message(
            state,
            end=router_pb2.TurnEnd(
                finish_reason=reason,
                usage=turn_usage(finished, len(outcome.token_ids)),
                timings=timings,
                replica=replica,
                model=outcome.model,
                retries=outcome.retries,
                failovers=outcome.failovers,
                degraded=bool(state.degraded),
                degraded_reasons=state.degraded,
                citations=state.citations,
                session_id=request.session_id,
                session_version=version,
                error_message=error,
            ),
        )
