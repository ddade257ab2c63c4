"""The turn pipeline: admission → history → RAG → cache → pick replica → relay → save → fill cache.

One authenticated turn in, a stream of ChatResponse out (tokens, then one
TurnEnd), each numbered ``(request_id, seq)``. Chat, ChatStream, Complete and
async tasks all run turns through here. This module keeps the order of the
steps; each step is its own module in ``turns/``: ``sources.py`` (history,
RAG, pin, save), ``cache_step.py``, ``checkpoints.py``, ``turn_end.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable, Sequence
from typing import Any

from services.common import errors
from services.gen.llmmesh.v1 import common_pb2, inference_pb2, router_pb2
from services.router import metrics
from services.router.admission.auth import Principal
from services.router.placement import cache_scope
from services.router.placement.request import PlacementRequest
from services.router.streams.relay import RelayOutcome
from services.router.streams.replay_writer import ReplayWriter
from services.router.turns import cache_step, sources
from services.router.turns.checkpoints import (
    OnAdmitted,
    OnCheckpoint,
    OnStopped,
    ResumePoint,
    checkpoint_of,
    resumed_start,
)
from services.router.turns.dependencies import TurnServices
from services.router.turns.response_cache import CachedAnswer
from services.router.turns.turn_end import (
    TurnState,
    next_message,
    stopped_end,
    token_message,
    turn_end,
    turn_usage,
)
from services.router.turns.validation import turn_request_id, validate

log = logging.getLogger("llmmesh.router.turn")

# A turn that finds no model known while replicas await their first health check waits this
# long at most (and never past its deadline) before UNAVAILABLE.
STARTUP_WAIT_S = 5.0


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
        replayable: bool = True,
        admitted: bool = False,
        on_admitted: OnAdmitted | None = None,
    ) -> AsyncGenerator[router_pb2.ChatResponse, None]:
        """The turn's messages: token deltas, then one TurnEnd. ``deadline`` is on ``services.clock``.

        ``on_checkpoint`` (async tasks) is awaited before the first token goes out; ``resume``
        finishes a turn from its checkpoint, after the tokens already delivered. A turn
        cancelled or failed before its TurnEnd cannot yield one: ``on_stopped`` is given the
        TurnEnd it would have sent (CANCELLED or ERROR, with the usage of what was streamed).
        ``replayable``: its messages go to the Resume buffer. An async task's do not: the task
        keeps its own events (``WatchTask``), and each attempt of it numbers its messages from
        1 again, which a buffer keyed by the request id would splice into the last attempt's.
        ``admitted``: an earlier attempt of this request (an async task's) was admitted against
        the key's request rate, so this one is not; ``on_admitted`` is awaited once it is.
        """
        validate(request)
        s = self.s
        state = TurnState(turn_request_id(request), s.clock())
        writer = None
        if s.replay is not None and replayable:
            writer = ReplayWriter(s.replay, state.request_id, principal.tenant)
        # The message being written to the client: it goes to the replay buffer once that
        # write is done (the caller asks for the next one), so the buffer's Redis round trip
        # never competes with the client's own hop for the CPU (measured: +0.3-0.7 ms per
        # paced message on an idle 2-vCPU box when the buffer wrote first).
        unbuffered: router_pb2.ChatResponse | None = None
        metrics.IN_FLIGHT.inc()
        slot = s.inflight.slot() if s.inflight is not None else contextlib.nullcontext()
        try:
            with slot:
                turn = self._turn(
                    principal, request, deadline, state, resume, on_checkpoint, admitted, on_admitted
                )
                async for response in turn:
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
            self._charge_streamed(principal, state)
            self._stop(state, request, writer, unbuffered, on_stopped, common_pb2.FINISH_REASON_CANCELLED)
            raise
        except Exception as exc:
            # The client gets a gRPC status; the replay buffer gets an ERROR TurnEnd saying why.
            self._charge_streamed(principal, state)
            self._stop(
                state, request, writer, unbuffered, on_stopped, common_pb2.FINISH_REASON_ERROR, str(exc)
            )
            raise
        finally:
            metrics.IN_FLIGHT.dec()
            if writer is not None:
                await writer.close()

    def _charge_streamed(self, principal: Principal, state: TurnState) -> None:
        """A turn that stopped without its replica's end (cancelled, failed part-way) is charged its
        prompt and the tokens it streamed. The prompt's count comes with the first token: before
        2026-12-07 it came only with the end, so a stream cancelled after one token prefilled any
        prompt for free. A resumed task's prompt was an earlier attempt's to charge. A turn whose
        TurnEnd went out was charged with it (``_bookkeeping``), or here before it."""
        limiter = self.s.rate_limiter
        new = state.streamed - state.resumed
        if limiter is None or state.ended or new <= 0 or not limiter.counts_tokens(principal):
            return
        prompt = state.outcome.prompt_tokens if state.outcome is not None and not state.resumed else 0
        self._in_background(limiter.record_tokens(principal, prompt + new))

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
        stopped = stopped_end(state, request, self.s.clock(), reason, error)
        if writer is not None:
            writer.put(stopped)
        if on_stopped is not None:
            on_stopped(stopped)

    async def _turn(
        self,
        principal: Principal,
        request: router_pb2.ChatRequest,
        deadline: float | None,
        state: TurnState,
        resume: ResumePoint | None = None,
        on_checkpoint: OnCheckpoint | None = None,
        admitted: bool = False,
        on_admitted: OnAdmitted | None = None,
    ) -> AsyncIterator[router_pb2.ChatResponse]:
        s = self.s
        tenant = principal.tenant
        if s.rate_limiter is not None and resume is None and not admitted:
            # A task's turn is admitted once: a dead router's takeover, a redelivery after an
            # outage before the first token, or a retry once the replicas were busy does not
            # spend another of the key's requests (a resumed one ran, so it was admitted).
            await s.rate_limiter.admit_request(principal)
            if on_admitted is not None:
                await on_admitted()
        new_messages = [(m.role, m.content) for m in request.messages]
        pinned: str | None = None
        if resume is not None:
            # The prompt, model and session version were settled before the first token: looking
            # them up again could give another prompt, which the delivered tokens do not continue.
            start = resumed_start(resume, state)
            models = [resume.checkpoint.model]
            raw = raw_prompt(start.prompt, start.prompt_token_ids)
            messages = raw or [(m.role, m.content) for m in start.messages]
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
            if request.prompt or request.prompt_token_ids:
                messages, prompt = raw_prompt(request.prompt, request.prompt_token_ids), ()
            elif request.session_id or request.rag.enabled:
                history, chunks, pinned = await sources.lookups(s, tenant, request, new_messages, state)
                messages = sources.build_prompt(history, chunks, new_messages)
                prompt = [common_pb2.ChatMessage(role=r, content=c) for r, c in messages]
            else:
                # No history, no sources: the prompt is the request's messages, copied as they are.
                messages, prompt = new_messages, request.messages
            start = inference_pb2.GenerateStart(
                request_id=state.engine_id,
                messages=prompt,
                prompt=request.prompt,
                prompt_token_ids=request.prompt_token_ids,
                sampling=request.sampling,
                cache_salt=cache_scope.generation_salt(s.prefix_cache_scope, tenant, request.cache_salt),
            )
        plan = cache_step.cache_plan(s, request, models[0], messages, resume is not None, state.cited)
        key = plan.key

        if plan.may_read:
            hit = await cache_step.cache_lookup(s, tenant, plan, request, models[0], state)
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
            state.streamed = state.resumed = len(
                resume.token_ids
            )  # an earlier attempt's: the client has them
        clock = s.clock
        request_id = state.request_id
        previous_at: float | None = None
        try:
            placement = PlacementRequest(
                models,
                session_key,
                pinned,
                deadline=deadline,
                request_id=request_id,
                prefix=await s.prompt_prefix(start, models[0]),
            )
            relayed = s.relay.generate(start, placement, outcome)
            # The per-message path: one clock read, one histogram sample, one proto built in place.
            async for batch in relayed:
                now = clock()
                if previous_at is None:
                    metrics.TTFT.observe(now - state.started)
                    if on_checkpoint is not None and resume is None:
                        await on_checkpoint(checkpoint_of(start, outcome, request, state))
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
                self._charge_streamed(principal, state)
                yield turn_end(state, request, outcome, s.clock(), error=str(exc))
                return
            if not request.allow_degraded:
                raise
            # A client that said not to read the cache (bypass, refresh) gets no stale answer either.
            stale_key = key if plan.may_read else None
            async for response in self._degraded(principal, request, stale_key, str(exc), state):
                yield response
            return

        if request.session_id and outcome.replica and s.on_session_served is not None:
            s.on_session_served(outcome.replica, tenant, request.session_id, start.cache_salt)
        # The pin and the token charge change nothing in the TurnEnd: they are written while it goes
        # out, and the turn (so the call) ends only once they landed.
        usage = turn_usage(outcome.finished, len(outcome.token_ids), outcome.prompt_tokens)
        bookkeeping = self._bookkeeping(principal, request, outcome, usage, pinned)
        answer = "".join(outcome.text_parts)
        finished = outcome.finished
        complete = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        fill = (
            plan.may_fill and key is not None and finished is not None and finished.finish_reason in complete
        )
        if fill and state.session is not None:
            # The session version and cache-fill errors are in the TurnEnd: both before it, at once.
            version, _ = await asyncio.gather(
                sources.save_turn(s, tenant, request, new_messages, answer, state),
                cache_step.cache_fill(s, tenant, plan, outcome, usage, answer, state),
            )
        else:
            # Nothing to wait for on a turn without session or cache: its TurnEnd goes out at once.
            version = 0
            if state.session is not None:
                version = await sources.save_turn(s, tenant, request, new_messages, answer, state)
            if fill:
                await cache_step.cache_fill(s, tenant, plan, outcome, usage, answer, state)
        if finished is not None:
            metrics.PROMPT_TOKENS.inc(finished.usage.prompt_tokens)
        metrics.COMPLETION_TOKENS.inc(len(outcome.token_ids))
        yield turn_end(state, request, outcome, s.clock(), version=version)
        if bookkeeping is not None:
            await asyncio.shield(bookkeeping)  # a cancel here must not cancel the writes

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
        return self._in_background(asyncio.gather(*writes))

    def _in_background(self, work: Awaitable[Any]) -> asyncio.Future[Any]:
        """``work`` as a task of its own, held until done (a client leaving does not cancel it)."""
        task = asyncio.ensure_future(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

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
            yield next_message(
                state, delta=router_pb2.TokenDelta(text=answer.text, token_ids=answer.token_ids, index=0)
            )
        if degraded_reason:
            state.degraded.append(degraded_reason)
        version = 0
        if degraded_reason is None:
            new_messages = [(m.role, m.content) for m in request.messages]
            version = await sources.save_turn(
                self.s, principal.tenant, request, new_messages, answer.text, state
            )
        outcome = RelayOutcome(model=answer.model)
        end = turn_end(state, request, outcome, self.s.clock(), version=version)
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
        answer, layer = await cache_step.fallback_answer(self.s, principal.tenant, key)
        async for response in self._replay_answer(
            principal, request, answer, layer, state, degraded_reason=f"fallback answer: {reason}"
        ):
            yield response


def raw_prompt(text: str, token_ids: Sequence[int]) -> list[tuple[str, str]]:
    """A raw prompt as the (role, content) pairs its cache key is made of; empty for a chat turn.

    "prompt" and "prompt_token_ids" are not chat roles, so a raw prompt's key never meets a chat
    turn's with the same text (the two are answered differently), nor a text prompt's the ids'
    (a text and the ids it would tokenize to are different requests to the client)."""
    if token_ids:
        return [("prompt_token_ids", ",".join(map(str, token_ids)))]
    return [("prompt", text)] if text else []
