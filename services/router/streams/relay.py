"""The hot path: relay one generation from a replica to the client, with retries and failover.

Before the first token a failed attempt is retried on another replica with
exponential backoff and jitter; after tokens have flowed the stream resumes on
another replica with ``resume_token_ids``, so the client sees one unbroken
stream. The client's deadline bounds every attempt; cancelling the consumer
cancels the replica's call at once. What a failed attempt means is
``attempts.py``'s; stall detection is ``watchdog.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from services.common import errors
from services.common.generate_many.client import StreamBroken
from services.gen.llmmesh.v1 import common_pb2, inference_pb2
from services.router import metrics
from services.router.placement.outliers import FailureKind
from services.router.placement.picker import ReplicaPicker
from services.router.placement.pipeline import BalancingPolicy, Decision
from services.router.placement.pool import Replica, ReplicaPool
from services.router.placement.request import PlacementRequest
from services.router.streams.attempts import BUSY_RETRY_AFTER_S, AttemptFailed, ReplicaBusy, replica_failure
from services.router.streams.watchdog import Watchdog

log = logging.getLogger("llmmesh.router.relay")


def count_placement(decision: Decision[Replica], request: PlacementRequest) -> None:
    """The picker's ``on_decision``: the reason always; the prefix hit where the prompt was hashed
    (``--policy prefix`` with a tokenizer) and the policy, not a pin, chose."""
    metrics.PLACEMENTS.labels(reason=decision.reason).inc()
    if request.prefix_hashes and decision.reason != "pin":
        metrics.PREFIX_HIT_TOKENS.observe(decision.cached_prefix_tokens)
        metrics.PREFIX_PROMPT_TOKENS.inc(request.prompt_tokens)


#: How much longer than the replica's learned prefill cost a prompt may take to its first token
#: (the cost is an average; queueing and a longer-than-usual prompt's attention add to it).
PREFILL_MARGIN = 2.0
#: Without the router's tokenizer, a prompt's tokens from its UTF-8 size: SmolLM2's tokenizer
#: took 2.1-3.9 bytes a token across prose, code and JSON; fewer bytes a token errs long.
PROMPT_BYTES_PER_TOKEN = 2


def estimated_prompt_tokens(start: inference_pb2.GenerateStart) -> int:
    """The prompt's tokens when the router does not know them: its token ids, or its text's size."""
    if start.prompt_token_ids:
        return len(start.prompt_token_ids)
    size = len(start.prompt.encode()) + sum(len(m.content.encode()) for m in start.messages)
    return size // PROMPT_BYTES_PER_TOKEN


def ttft_limit(base_s: float, prefill_s_per_token: float | None, prompt_tokens: int) -> float:
    """How long an attempt may wait for its first token: ``--ttft-timeout-s`` plus twice what its
    prompt is expected to take to prefill on that replica (its learned cost per token).

    A fixed limit failed valid long prompts where prefill is slow: on a 2-core CPU an
    8,181-token prompt took over 60 s to its first token, so it was refused (503) after trying
    every replica, and each try counted towards ejecting a healthy replica. Before a replica has
    finished a generation its cost is unknown, and the base alone applies.
    """
    if not prefill_s_per_token or prompt_tokens <= 0:
        return base_s
    return base_s + PREFILL_MARGIN * prompt_tokens * prefill_s_per_token


@dataclass(frozen=True)
class RelayConfig:
    """Retry, failover and stall-detection settings."""

    max_attempts: int = 3
    backoff_base_s: float = 0.05
    backoff_max_s: float = 1.0
    #: No first token within this long, plus the prompt's expected prefill (``ttft_limit``): the
    #: attempt counts as failed (TTFT timeout).
    ttft_timeout_s: float = 60.0
    #: No token for this long once tokens flowed: an inter-token stall.
    stall_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("--max-attempts must be >= 1")
        if self.backoff_base_s < 0 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError("backoff: need 0 <= base <= max")


@dataclass
class RelayOutcome:
    """What happened while relaying, for the TurnEnd and the metrics."""

    replica: str = ""
    model: str = ""
    retries: int = 0
    failovers: int = 0
    finished: inference_pb2.GenerationFinished | None = None
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    replicas_used: list[str] = field(default_factory=list)
    #: The prompt's token count, from an attempt's first chunk (0 until one came): what a turn that
    #: stops before the replica's end is charged for its prompt.
    prompt_tokens: int = 0


class Relay:
    """Picks replicas and streams one generation's chunks through, surviving replica failures."""

    def __init__(
        self,
        pool: ReplicaPool,
        policy: BalancingPolicy,
        config: RelayConfig | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        #: Where each attempt goes (placement/picker.py); failover asks it again, minus those tried.
        self.picker = ReplicaPicker(pool, policy, clock, on_decision=count_placement)
        self.config = config or RelayConfig()
        self._rng = rng or random.Random()
        self._clock = clock

    async def generate(
        self,
        start: inference_pb2.GenerateStart,
        placement: PlacementRequest,
        outcome: RelayOutcome,
    ) -> AsyncIterator[list[inference_pb2.TokenChunk]]:
        """Yield the answer's chunks in batches (what arrived while the previous batch was out);
        ``outcome`` says how it ended and where it ran. ``placement`` is what the turn knows
        for choosing a replica (models, session, pin, deadline, the prompt's prefix blocks);
        each attempt asks the picker again with the replicas tried so far excluded."""
        deadline = placement.deadline
        tried: set[str] = set()
        attempts = 0
        last_error = "no attempt made"
        #: Every attempt so far was refused as busy: the client is told to back off, not that
        #: the replicas are down.
        all_busy = True
        while True:
            if deadline is not None and self._clock() >= deadline:
                raise errors.DeadlineExceeded("deadline passed before the answer finished")
            # Once tokens flowed the answer must continue on the same model: token ids differ across models.
            allowed = [outcome.model] if outcome.token_ids else placement.models
            placing = replace(placement, models=allowed, exclude=placement.exclude | tried)
            picked = self.picker.place(placing)
            if picked is None and tried:
                # Every replica tried once: allow the others again, never the one that just failed.
                placing = replace(
                    placement, models=allowed, exclude=frozenset({outcome.replica}), pinned=None
                )
                picked = self.picker.place(placing)
            if picked is None:
                names = ", ".join(allowed)
                if not attempts:
                    raise errors.DependencyUnavailable(f"no healthy replica of model {names}")
                raise self._gave_up(
                    f"no replica of model {names} can serve ({last_error})", all_busy, outcome
                )
            replica, model = picked
            attempts += 1
            outcome.replica, outcome.model = replica.address, model
            outcome.replicas_used.append(replica.address)
            tried.add(replica.address)
            attempt = self._attempt(replica, start, outcome, deadline, placing.prompt_tokens)
            tokens_before, finished, prefilled = len(outcome.token_ids), False, False
            try:
                async for batch in attempt:
                    if not prefilled:
                        # Its first tokens: the prompt is in that replica's cache now, no longer
                        # work on its way there (what the prefix policy counts as queued prefill).
                        prefilled = True
                        self.picker.prefilled(replica, placing)
                    yield batch
                finished = True
                return
            except AttemptFailed as failure:
                last_error = f"{replica.address}: {failure}"
                all_busy = all_busy and isinstance(failure, ReplicaBusy)
                if failure.kind is not None:
                    self.pool.report_failure(replica, failure.kind)
                if attempts >= self.config.max_attempts:
                    raise self._gave_up(
                        f"gave up after {attempts} attempts; last: {last_error}", all_busy, outcome
                    ) from None
                if outcome.token_ids:
                    outcome.failovers += 1
                    metrics.FAILOVERS.inc()
                    log.warning(
                        "failing over %s after %d tokens: %s",
                        start.request_id,
                        len(outcome.token_ids),
                        last_error,
                    )
                else:
                    outcome.retries += 1
                    metrics.RETRIES.inc()
                    await self._backoff(outcome.retries, deadline)
            finally:
                # A consumer that stops reading must cancel the replica's call now, not at GC.
                await attempt.aclose()
                if not finished and len(outcome.token_ids) == tokens_before:
                    # Ended before its first token there (refused, failed, cancelled while
                    # queued): its prompt is not on its way into that replica's cache.
                    self.picker.withdraw(replica, placing)

    @staticmethod
    def _gave_up(message: str, all_busy: bool, outcome: RelayOutcome) -> errors.MeshError:
        """Why the relay stops trying: overload (back off, retry) when every replica it tried
        was busy and nothing streamed yet; else the replicas could not serve (UNAVAILABLE).

        After tokens the turn ends in-band (turn.py), whatever the reason, so busy is only
        RESOURCE_EXHAUSTED before the first token.
        """
        if all_busy and not outcome.token_ids:
            return errors.Overloaded(f"every replica is busy: {message}", retry_after_s=BUSY_RETRY_AFTER_S)
        return errors.DependencyUnavailable(message)

    async def _backoff(self, retry: int, deadline: float | None) -> None:
        cap = min(self.config.backoff_max_s, self.config.backoff_base_s * (2 ** (retry - 1)))
        delay = cap / 2 + self._rng.random() * cap / 2  # "equal jitter": spread, never zero
        if deadline is not None and self._clock() + delay >= deadline:
            raise errors.DeadlineExceeded("deadline too close to retry on another replica")
        await asyncio.sleep(delay)

    async def _attempt(
        self,
        replica: Replica,
        start: inference_pb2.GenerateStart,
        outcome: RelayOutcome,
        deadline: float | None,
        prompt_tokens: int = 0,
    ) -> AsyncGenerator[list[inference_pb2.TokenChunk], None]:
        request = start
        if outcome.token_ids:
            request = inference_pb2.GenerateStart()
            request.CopyFrom(start)
            request.resume_token_ids.extend(outcome.token_ids)
        timeout = None if deadline is None else max(0.001, deadline - self._clock())
        generation = replica.mux.open(request, timeout)
        constrained = request.sampling.WhichOneof("constraint") is not None
        watchdog = Watchdog(
            generation,
            ttft_limit(
                self.config.ttft_timeout_s,
                replica.prefill_s_per_token,
                (prompt_tokens or estimated_prompt_tokens(start)) + len(outcome.token_ids),
            ),
            self.config.stall_timeout_s,
            self._clock,
            ttft_blames_replica=not constrained,
        )
        replica.in_flight += 1
        clock = self._clock
        sent_at = clock()
        last_at = sent_at
        try:
            # The per-batch path: one wait, one clock read, each field read once, nothing copied.
            while True:
                events = await generation.events()
                batch = []
                # The generation's end, when it failed: raised once the chunks that came with it
                # (a replica sends a step's tokens and a failure in one message) are the client's,
                # so a failover resumes after them and a passed-on status follows them.
                failure: Exception | None = None
                for event in events:
                    kind = event.WhichOneof("event")
                    if kind == "chunk":
                        batch.append(event.chunk)
                        continue
                    if kind == "error":
                        failure = replica_failure(replica.address, event.error, deadline, self._clock)
                        break
                    done = event.finished
                    if done.finish_reason == common_pb2.FINISH_REASON_ERROR:
                        failure = AttemptFailed(f"replica error: {done.error_message}", FailureKind.ERROR)
                        break
                    outcome.finished = done
                    # The replica's own timings: what a prompt costs there (the prefix policy's cost).
                    usage, timings = done.usage, done.timings
                    replica.costs.observe(
                        usage.prompt_tokens,
                        usage.cached_prompt_tokens,
                        timings.prefill_ms / 1000,
                        timings.decode_ms / 1000,
                    )
                    break
                if batch:
                    now = clock()
                    tokens = 0
                    for chunk in batch:
                        token_ids = chunk.token_ids
                        tokens += len(token_ids)
                        outcome.token_ids.extend(token_ids)
                        outcome.text_parts.append(chunk.text)
                    if watchdog.started:
                        replica.itl.observe((now - last_at) / (tokens or 1))
                    else:
                        watchdog.started = True
                        replica.ttft.observe(now - sent_at)
                        # The attempt's first chunk says what its prompt has (read once an attempt).
                        outcome.prompt_tokens = max(outcome.prompt_tokens, *(c.prompt_tokens for c in batch))
                        if outcome.first_token_at is None:
                            outcome.first_token_at = now
                    last_at = watchdog.last_progress = now
                if outcome.finished is not None:
                    self.pool.report_success(replica)
                    if batch:
                        yield batch
                    return
                if batch:
                    # Time spent handing the batch to a slow client is the client's, not the
                    # replica's: it counts neither as a stall nor in the replica's inter-token time.
                    watchdog.with_client = True
                    yield batch
                    watchdog.with_client = False
                    last_at = watchdog.last_progress = clock()
                if failure is not None:
                    raise failure
        except StreamBroken as exc:
            raise AttemptFailed(f"{replica.address}: {exc}", FailureKind.ERROR) from None
        finally:
            watchdog.stop()
            replica.in_flight -= 1
            generation.close()
