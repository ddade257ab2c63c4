"""A turn's messages to the client: its numbering, token deltas, the TurnEnd and its usage."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from services.common.generate_many.merge import merge
from services.gen.llmmesh.v1 import common_pb2, inference_pb2, router_pb2
from services.router import metrics
from services.router.streams.relay import RelayOutcome
from services.router.turns.context import SessionHistory


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
    #: Of ``streamed``, those an earlier attempt of a resumed task delivered: not this attempt's
    #: to charge when it stops part-way (the attempt that finishes charges the whole answer).
    resumed: int = 0
    #: (document id, version) of the RAG context's documents: a semantic entry cites them.
    cited: list[tuple[str, int]] = field(default_factory=list)
    #: A semantic-cache entry found but not served (its confidence refused it, or a refresh
    #: was due): (entry id, its answer, similarity), compared with the fresh answer to learn.
    semantic_candidate: tuple[str, str, float] | None = None
    #: The id the replicas know the turn's generation by: the request id and a suffix of this
    #: router's. A request id is the client's, so two tenants (or one, retrying) may send the
    #: same one at once: the second was ALREADY_EXISTS on the replica, told to the client as
    #: UNAVAILABLE and counted against the replica's health, and a cancel by id could end
    #: another tenant's generation. The request id stays its prefix, for the logs.
    engine_id: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.engine_id:
            self.engine_id = f"{self.request_id}.{secrets.token_hex(4)}"


def token_message(
    request_id: str, seq: int, batch: list[inference_pb2.TokenChunk]
) -> router_pb2.ChatResponse:
    """One ChatResponse whose TokenDelta carries consecutive chunks merged by GenerateMany's one
    rule (``merge.merge``), filled in place (no copy of a delta)."""
    response = router_pb2.ChatResponse(request_id=request_id, seq=seq)
    delta = response.delta
    if len(batch) == 1:  # the common case, a reader keeping up: nothing to merge
        first = batch[0]
        delta.index = first.index
        delta.text = first.text
        delta.token_ids.extend(first.token_ids)
        delta.logprobs.extend(first.logprobs)
        delta.prompt_logprobs.extend(first.prompt_logprobs)
        delta.prompt_text = first.prompt_text
        delta.prompt_tokens = first.prompt_tokens
        return response
    delta.index, delta.text = merge(batch, delta.token_ids)
    for chunk in batch:  # one per token id, in the same order (empty unless asked for)
        delta.logprobs.extend(chunk.logprobs)
        delta.prompt_logprobs.extend(chunk.prompt_logprobs)  # the first chunk's, if asked for
        delta.prompt_text += chunk.prompt_text  # likewise
        delta.prompt_tokens = max(delta.prompt_tokens, chunk.prompt_tokens)  # likewise
    return response


def turn_usage(
    finished: inference_pb2.GenerationFinished | None, completion_tokens: int, prompt_tokens: int = 0
) -> common_pb2.Usage:
    """A turn's usage: what the client received, the prompt once.

    ``completion_tokens`` is every answer token the client got, across failovers (a replica
    counts only what it generated itself, not the tokens it resumed after). Every attempt
    reads the same prompt, so the prompt is counted once, with ``cached_prompt_tokens``, from
    the attempt that finished (capped at the prompt: its prefix cache may also hold resumed
    tokens, which are answer, not prompt). A turn no attempt finished takes ``prompt_tokens``
    from an attempt's first chunk (``RelayOutcome.prompt_tokens``; 0 before any token came:
    unknown, never guessed).
    """
    usage = common_pb2.Usage(completion_tokens=completion_tokens, prompt_tokens=prompt_tokens)
    if finished is not None:
        usage.prompt_tokens = finished.usage.prompt_tokens
        usage.cached_prompt_tokens = min(finished.usage.cached_prompt_tokens, usage.prompt_tokens)
    return usage


def next_message(state: TurnState, **event: Any) -> router_pb2.ChatResponse:
    """The turn's next message, numbered after the last one."""
    state.seq += 1
    return router_pb2.ChatResponse(request_id=state.request_id, seq=state.seq, **event)


def turn_end(
    state: TurnState,
    request: router_pb2.ChatRequest,
    outcome: RelayOutcome,
    now: float,
    version: int = 0,
    error: str = "",
) -> router_pb2.ChatResponse:
    """The turn's last message."""
    state.ended = True
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
    return _end_message(
        state,
        request,
        outcome,
        reason=reason,
        usage=turn_usage(finished, len(outcome.token_ids), outcome.prompt_tokens),
        timings=timings,
        replica=replica,
        version=version,
        error=error,
    )


def stopped_end(
    state: TurnState, request: router_pb2.ChatRequest, now: float, reason: int, error: str = ""
) -> router_pb2.ChatResponse:
    """The TurnEnd of a turn that did not end by itself (cancelled, or failed with a status).

    Its usage is the tokens streamed before it stopped (and the prompt's, once its first token
    came), and its replica the one that made them.
    """
    state.ended = True
    outcome = state.outcome or RelayOutcome()
    timings = common_pb2.Timings(total_ms=(now - state.started) * 1000)
    if outcome.first_token_at is not None:
        timings.ttft_ms = (outcome.first_token_at - state.started) * 1000
    return _end_message(
        state,
        request,
        outcome,
        reason=reason,
        usage=turn_usage(None, state.streamed, outcome.prompt_tokens),
        timings=timings,
        replica=state.streamed_by,
        error=error,
    )


def _end_message(
    state: TurnState,
    request: router_pb2.ChatRequest,
    outcome: RelayOutcome,
    *,
    reason: int,
    usage: common_pb2.Usage,
    timings: common_pb2.Timings,
    replica: str,
    version: int = 0,
    error: str = "",
) -> router_pb2.ChatResponse:
    """The TurnEnd message, the one place its fields are filled.

    What differs between a finished and a stopped turn is passed in; the rest (model,
    retries, degradation, citations, session) is read from the turn the same way for both.
    """
    return next_message(
        state,
        end=router_pb2.TurnEnd(
            finish_reason=reason,  # type: ignore[arg-type]
            usage=usage,
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
