"""What the engine hands back: each step's per-request outputs, with usage and timings, and its load."""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.inference.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class Timings:
    """Milliseconds, as in the proto's Timings."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(frozen=True)
class SampledToken:
    """A drawn token with its log probability and the ``top`` (token id, logprob) alternatives,
    most likely first: what the sampler gives for a row whose request asked for logprobs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text: str
    # Position in the completion of new_token_ids[0] (resumed tokens count).
    index: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: str = ""
    matched_stop: str = ""
    #: The engine failed on this request alone (``error`` says how); the others go on.
    fault: bool = False
    #: One per new token, in order, when the request asked for logprobs; else empty.
    logprobs: tuple[SampledToken, ...] = ()
    #: In the request's first output, when it asked for prompt logprobs: one per prompt token, in
    #: order (``token`` is the prompt's own; the first's logprob is NaN: nothing precedes it).
    prompt_logprobs: tuple[SampledToken, ...] = ()
    #: In the request's first output with a new token: its prompt's token count (resumed tokens
    #: not counted); 0 in the others. What a cancelled request's prompt cost, for the router.
    prompt_tokens: int = 0
    #: The request's own input cannot go on (its output constraint dead-ended): the field to
    #: name in its INVALID_ARGUMENT, ``error`` saying why. Not a fault: the engine is fine.
    invalid_field: str = ""


@dataclass(frozen=True)
class EngineLoad:
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int
    tokens_per_second: float
    #: Sequences held out of scheduling because their readers stopped taking tokens.
    parked: int = 0


def final_output(
    seq: Sequence, tokens: list[int], text: str, index: int | None = None, matched_stop: str = ""
) -> RequestOutput:
    """The last output of a finished (or aborted, or failed) sequence, with its usage and timings."""
    end = seq.finished_time or time.monotonic()
    first = seq.first_scheduled_time
    prefill_done = seq.prefill_done_time
    timings = Timings(
        queue_ms=_ms(seq.arrival_time, first or end),
        prefill_ms=_ms(first, prefill_done) if first is not None and prefill_done is not None else 0.0,
        decode_ms=_ms(prefill_done, end) if prefill_done is not None else 0.0,
        ttft_ms=_ms(seq.arrival_time, seq.first_token_time) if seq.first_token_time is not None else 0.0,
        total_ms=_ms(seq.arrival_time, end),
    )
    usage = Usage(
        prompt_tokens=seq.num_prompt_tokens,
        completion_tokens=seq.num_generated_tokens,
        cached_prompt_tokens=seq.num_cached_prompt_tokens,
    )
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=tokens,
        text=text,
        index=seq.num_output_tokens if index is None else index,
        finished=True,
        finish_reason=seq.finish_reason,
        usage=usage,
        timings=timings,
        error=seq.error,
        matched_stop=matched_stop,
    )


def _ms(start: float, end: float) -> float:
    return max(0.0, (end - start) * 1000.0)
