"""The synchronous engine core: add requests, then ``step()`` until none are left.

Each step reads as schedule -> execute -> update; aborts requested meanwhile
(from any thread) are applied between execute and update.

A fault is confined to the request that caused it. The sampler draws each row on
its own (a row it cannot draw is a ``RowFault``); a forward that raises is run
again on the step's chunks in halves, in order, until the chunks that fail alone
are found (``fault_isolation.py``). Those requests end with ``FINISH_REASON_ERROR`` (``fault`` set), the
others keep the tokens they would have had. Only an engine-wide failure (out of
memory, the device lost, or every chunk failing alone) leaves ``step()`` as
``EngineFailure``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from services.common import errors
from services.common.model_names import served_model_name
from services.inference.block_manager import BlockManager
from services.inference.config import EngineConfig
from services.inference.detokenizer import DetokenizerUpdate, IncrementalDetokenizer, fast_decoder
from services.inference.fault_isolation import ChunkResult, EngineFailure, run_isolating_faults
from services.inference.gguf_loading import gguf_read_once
from services.inference.grammar import GrammarCompiler, Guide
from services.inference.model_loading import check_model_path, load_tokenizer
from services.inference.model_runner import ModelRunner
from services.inference.outputs import EngineLoad, RequestOutput, SampledToken, final_output
from services.inference.sampler import RowFault
from services.inference.sampling import SamplingParams
from services.inference.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from services.inference.sequence import Sequence, SequenceStatus

# The engine's interface, as its callers import it: step() raises EngineFailure and returns
# RequestOutputs; load() answers an EngineLoad (the types live in fault_isolation.py and outputs.py).
__all__ = ["EngineFailure", "EngineLoad", "LLMEngine", "RequestOutput"]

log = logging.getLogger("llmmesh.inference.engine")

# Tokens/s is averaged over this many recent seconds.
THROUGHPUT_WINDOW_S = 5.0


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    #: Its output constraint's matcher (None = free text): fills its bitmask row, eats its tokens.
    guide: Guide | None = None


#: An answer's state before its constraint is judged: going on, or cut by its length (which a
#: constraint completed by the same token overrides).
_CUT_OR_GOING = (None, SequenceStatus.FINISHED_LENGTH)


class LLMEngine:
    """Continuous batching over one model on one device."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        check_model_path(config.model)  # before anything is loaded or allocated
        with gguf_read_once(config.model):  # a .gguf model: one parse for the weights and the tokenizer
            self.runner = ModelRunner(config)
            self.tokenizer = load_tokenizer(config.model)
        # Text of new tokens: the tokenizer's own Rust decoder where it decodes the same.
        self._decoder = fast_decoder(self.tokenizer)
        self.model_id = config.model_id or served_model_name(config.model)
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self._requests: dict[str, _Request] = {}
        self._aborts: deque[str] = deque()
        # Resumed requests whose resumed tokens already ended the answer: they end at the next
        # step, with their reason (and the stop string they ended on), generating nothing.
        self._ended: deque[tuple[str, SequenceStatus, str]] = deque()
        # (request id, park?) in the order asked: a park and the unpark after it must not swap.
        self._parks: deque[tuple[str, bool]] = deque()
        self._control_lock = threading.Lock()
        self._eos_ids = _eos_ids(self.runner.model, self.tokenizer)
        self.runner.sampler.end_ids = tuple(sorted(self._eos_ids))
        self._recent: deque[tuple[float, int]] = deque()
        # Sequences preempted so far (KV dropped for recompute): a sign the cache is too small.
        self.num_preemptions = 0
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size)

    def with_bad_word_ids(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its ``bad_words`` tokenized (``bad_word_ids``): each word as written and
        after a space (mid-sentence), as vLLM does. Call it off the step loop, as ``make_guide``."""
        if not params.bad_words or params.bad_word_ids:
            return params
        sequences: set[tuple[int, ...]] = set()
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    sequences.add(ids)
        return dataclasses.replace(params, bad_word_ids=tuple(sorted(sequences)))

    def make_guide(self, params: SamplingParams, resume_token_ids: Seq[int] = ()) -> Guide | None:
        """The request's grammar matcher (cached compile, resumed tokens replayed), None for free text;
        ``InvalidArgument`` for a constraint or resume it refuses. Call it off the step loop."""
        return None if params.constraint is None else self.grammars.guide(params.constraint, resume_token_ids)

    def grammar_compiled(self, params: SamplingParams) -> bool:
        """Whether the request's guide is a copy of a compiled grammar (or it has none)."""
        return params.constraint is None or self.grammars.is_compiled(params.constraint)

    def make_detokenizer(
        self, params: SamplingParams, resume_token_ids: Seq[int] = ()
    ) -> IncrementalDetokenizer:
        """The request's text state, resumed tokens replayed (≈ 3 µs a token with the Rust decoder:
        12 ms for 4,096), so call it off the step loop for a resumed request."""
        prime = resume_token_ids
        if prime and prime[-1] in params.stop_token_ids and not params.include_stop_str_in_output:
            prime = prime[:-1]  # the stop token that ended the answer: its text was left out (_update)
        return IncrementalDetokenizer(
            self._decoder,
            params.stop,
            prime=prime,
            min_tokens=params.min_tokens,
            include_stop=params.include_stop_str_in_output,
        )

    # -- admission -----------------------------------------------------------
    def validate(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        resume_token_ids: Seq[int] = (),
        prompt_field: str = "prompt",
    ) -> None:
        """Raise ``InvalidArgument`` for a request this engine can never serve (no state touched).

        ``prompt_field``: what the request called its prompt (``messages``, ``prompt`` or
        ``prompt_token_ids``), so a refusal names the field the client sent.
        """
        total = len(prompt_token_ids) + len(resume_token_ids)
        if not prompt_token_ids:
            raise errors.InvalidArgument(prompt_field, "is empty after tokenization")
        # Resumed tokens that reach max_tokens are an answer that ended by its length (its
        # replica failed before it could say so): it ends at once, so it needs no room.
        if total >= self.max_model_len and len(resume_token_ids) < params.max_tokens:
            raise errors.ContextTooLong(
                prompt_field,
                f"{len(prompt_token_ids)} prompt tokens (+{len(resume_token_ids)} resumed) leave no room in",
                self.max_model_len,
            )
        if len(resume_token_ids) > params.max_tokens:
            raise errors.InvalidArgument(
                "resume_token_ids",
                f"{len(resume_token_ids)} resumed tokens are more than max_tokens ({params.max_tokens})",
            )
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise errors.ContextTooLong(
                "max_tokens",
                f"{params.max_tokens} plus {len(prompt_token_ids)} prompt tokens exceed",
                self.max_model_len,
            )
        if params.prompt_logprobs is not None and self.runner.native is None:
            raise errors.InvalidArgument(
                "prompt_logprobs", "not served by this replica's model implementation (transformers)"
            )
        vocab = self.runner.vocab_size
        # A tokenized prompt is always in range: one out of it was given as ids by the client.
        for name, ids in (("prompt_token_ids", prompt_token_ids), ("resume_token_ids", resume_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise errors.InvalidArgument(name, f"token ids must be in [0, {vocab}), got {bad}")
        for name, listed in (
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids),
        ):
            bad = next((t for t in listed if t >= vocab), None)
            if bad is not None:
                raise errors.InvalidArgument(name, f"token ids must be in [0, {vocab}), got {bad}")
        ends = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos_ids)
        if params.min_tokens and params.allowed_token_ids and set(params.allowed_token_ids) <= ends:
            # Only end tokens may be drawn and min_tokens holds them back: nothing could be
            # drawn (the answer ended at once with STOP, min_tokens silently dropped).
            raise errors.InvalidArgument(
                "min_tokens", "allowed_token_ids hold only end tokens, which min_tokens holds back"
            )

    def admit(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        resume_token_ids: Seq[int] = (),
        waiting: int | None = None,
    ) -> None:
        """Every refusal a request can meet before it takes a slot, in one place: ``InvalidArgument``
        for one this engine can never serve, ``Overloaded`` when ``waiting`` requests (default: the
        scheduler's queue) fill the waiting queue. Touches no state, so the async front runs it on
        its own thread and a refusal is immediate, never one engine step late."""
        self.validate(prompt_token_ids, params, resume_token_ids)
        self.check_room(waiting)

    def check_room(self, waiting: int | None = None) -> None:
        """``Overloaded`` when ``waiting`` requests (default: the scheduler's queue) fill the queue."""
        queued = len(self.scheduler.waiting) if waiting is None else waiting
        if queued >= self.config.max_queued_requests:
            raise errors.Overloaded(
                f"waiting queue is full ({self.config.max_queued_requests} requests); retry later",
                retry_after_s=1.0,
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume_token_ids: Seq[int] = (),
        cache_salt: str = "",
    ) -> None:
        """Admit (``admit``) and queue a request, for a caller that drives the engine itself."""
        self.admit(prompt_token_ids, params, resume_token_ids)
        guide = self.make_guide(params, resume_token_ids)
        self.enqueue(request_id, prompt_token_ids, params, resume_token_ids, guide, cache_salt=cache_salt)

    def enqueue(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume_token_ids: Seq[int] = (),
        guide: Guide | None = None,
        detokenizer: IncrementalDetokenizer | None = None,
        cache_salt: str = "",
    ) -> None:
        """Queue a request already admitted (the async front admits on arrival, see ``admit``),
        with its ``guide`` from ``make_guide`` when it has an output constraint and its
        ``detokenizer`` from ``make_detokenizer`` when it resumes (both made here otherwise)."""
        if request_id in self._requests:
            raise errors.AlreadyExists(f"request {request_id!r} is already running")
        params = self.with_bad_word_ids(params)  # a caller that skipped it (a no-op otherwise)
        seq = Sequence(
            request_id=request_id,
            token_ids=[*prompt_token_ids, *resume_token_ids],
            num_prompt_tokens=len(prompt_token_ids),
            num_resumed_tokens=len(resume_token_ids),
            params=params,
            seed=params.seed if params.seed is not None else random.getrandbits(63),
            cache_salt=cache_salt,
        )
        if params.prompt_logprobs is not None and not resume_token_ids:
            # (A resumed request's went out with its first token, from the replica that drew it.)
            # The first prompt token has nothing before it to be scored by: NaN, no alternatives.
            seq.prompt_logprobs = [SampledToken(prompt_token_ids[0], math.nan)]
            seq.prompt_logprobs += [None] * (len(prompt_token_ids) - 1)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos_ids)
        detok = detokenizer or self.make_detokenizer(params, resume_token_ids)
        guide = guide or self.make_guide(params, resume_token_ids)  # a caller that skipped make_guide
        req = _Request(seq, detok, stop_ids, guide)
        self._requests[request_id] = req
        self.scheduler.add(seq)
        if resume_token_ids and (end := self._resumed_end(req)) is not None:
            self._ended.append((request_id, *end))

    def _resumed_end(self, req: _Request) -> tuple[SequenceStatus, str] | None:
        """How the resumed tokens already ended the answer, if they did, as ``_update`` would have
        ended it at the last of them: a stop string, a stop token, a complete output constraint,
        or max_tokens. A replica can fail between an answer's last token and its end: the router
        then resumes the whole answer, which must end, not go on past its end."""
        if req.detokenizer.primed_stop is not None:
            return SequenceStatus.FINISHED_STOPPED, req.detokenizer.primed_stop
        # The last resumed token judged as _update judged it: a stop token or the length, then
        # a constraint it completed.
        status = self._check_stop(req, req.seq.token_ids[-1])
        if req.guide is not None and req.guide.finished and status in _CUT_OR_GOING:
            status = SequenceStatus.FINISHED_STOPPED
        return None if status is None else (status, "")

    def abort_request(self, request_id: str) -> None:
        """Ask for the request to end at the next step (safe from any thread)."""
        with self._control_lock:
            self._aborts.append(request_id)

    def park_request(self, request_id: str) -> None:
        """Stop computing the request from the next step until ``unpark_request`` (safe from any
        thread): its reader is not taking its tokens, so its seat and KV blocks go to others."""
        with self._control_lock:
            self._parks.append((request_id, True))

    def unpark_request(self, request_id: str) -> None:
        """Compute the parked request again (safe from any thread); it goes first in the queue."""
        with self._control_lock:
            self._parks.append((request_id, False))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborts) or bool(self._parks) or bool(self._ended)

    # -- the loop ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        # Aborted requests leave before scheduling: the requests of a step that raised are
        # aborted and must be released without running that step again.
        outputs = self._drain_aborts()
        outputs += self._drain_ended()
        self._apply_parks()
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted)
        results = run_isolating_faults(self._run, plan.scheduled) if plan.scheduled else []
        # Before the aborts of the step: a failed chunk's request aborted while it ran has
        # its blocks freed there, and what it filled must be known as garbage first.
        self._discard_failed_fills(plan.scheduled, results)
        outputs += self._drain_aborts()  # those aborted while the step ran
        outputs += self._update(plan, results)
        self.block_manager.events.publish()  # one KV-events delta per step, never one per block
        return outputs

    def _run(self, chunks: Seq[ScheduledSequence]) -> list[ChunkResult]:
        # Every chunk of the step is a live request's (aborts leave between steps).
        guides = [self._requests[c.seq.request_id].guide for c in chunks if c.samples]
        drawn = iter(self.runner.execute(chunks, guides if any(guides) else ()))
        return [next(drawn) if c.samples else None for c in chunks]

    def _apply_parks(self) -> None:
        with self._control_lock:
            parks = list(self._parks)
            self._parks.clear()
        for rid, park in parks:
            req = self._requests.get(rid)
            if req is None:
                continue  # finished or aborted meanwhile
            if park:
                self.scheduler.park(req.seq)
            else:
                self.scheduler.unpark(req.seq)

    def _drain_aborts(self) -> list[RequestOutput]:
        with self._control_lock:
            ids = list(self._aborts)
            self._aborts.clear()
        outputs = []
        for rid in ids:
            req = self._requests.pop(rid, None)
            if req is None:
                continue
            self.scheduler.finish(req.seq, SequenceStatus.FINISHED_ABORTED)
            outputs.append(final_output(req.seq, [], ""))
        return outputs

    def _drain_ended(self) -> list[RequestOutput]:
        """End the resumed requests whose answers had ended: no token and no text (the client
        has the whole answer: its last token's message carried all of it), their reason, usage."""
        outputs = []
        while self._ended:
            rid, status, matched_stop = self._ended.popleft()
            req = self._requests.pop(rid, None)
            if req is None:
                continue  # aborted meanwhile
            self.scheduler.finish(req.seq, status)
            outputs.append(final_output(req.seq, [], "", matched_stop=matched_stop))
        return outputs

    def _update(self, plan: SchedulerOutput, results: list[ChunkResult]) -> list[RequestOutput]:
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for seq in plan.errored:
            req = self._requests.pop(seq.request_id, None)
            if req is not None:
                outputs.append(final_output(req.seq, [], ""))
        generated = 0
        outputs += self._fail_faulted(plan.scheduled, results)
        for chunk, token in zip(plan.scheduled, results, strict=True):
            seq = chunk.seq
            if seq.is_finished or isinstance(token, RowFault) or seq.status is SequenceStatus.WAITING:
                continue  # aborted while the step ran, failed, or preempted by a failed chunk
            self.scheduler.advance(chunk)
            if seq.prefill_done_time is None and seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.prefill_done_time = now
            if token is None:
                continue
            logprobs, token = ((token,), token.token) if isinstance(token, SampledToken) else ((), token)
            req = self._requests[seq.request_id]
            index = seq.num_output_tokens
            seq.token_ids.append(token)
            generated += 1
            first = 0
            if seq.first_token_time is None:
                seq.first_token_time = now
                first = seq.num_prompt_tokens
            scored = self._take_prompt_logprobs(seq)
            status = self._check_stop(req, token)
            if (
                token in seq.params.stop_token_ids
                and status is SequenceStatus.FINISHED_STOPPED
                and not seq.params.include_stop_str_in_output
            ):
                # A stop token's own text is not part of the answer (vLLM's rule, unless asked);
                # the end-of-sequence tokens write none anyway.
                update = DetokenizerUpdate("")
            else:
                update = req.detokenizer.add(token)
            if update.matched_stop is not None:
                status = SequenceStatus.FINISHED_STOPPED
            if req.guide is not None:
                status = self._advance_guide(req, token, status)
            if status is None:
                outputs.append(
                    RequestOutput(
                        seq.request_id,
                        [token],
                        update.text,
                        index,
                        logprobs=logprobs,
                        prompt_logprobs=scored,
                        prompt_tokens=first,
                    )
                )
                continue
            self.scheduler.finish(seq, status)
            del self._requests[seq.request_id]
            text = update.text + ("" if update.matched_stop else req.detokenizer.flush())
            final = final_output(req.seq, [token], text, index, update.matched_stop or "")
            refused = req.guide.field if req.guide and status is SequenceStatus.FINISHED_ERROR else ""
            outputs.append(
                dataclasses.replace(
                    final,
                    logprobs=logprobs,
                    prompt_logprobs=scored,
                    invalid_field=refused,
                    prompt_tokens=first,
                )
            )
        if generated:
            self._recent.append((now, generated))
        return outputs

    def _discard_failed_fills(self, chunks: Seq[ScheduledSequence], results: Seq[ChunkResult]) -> None:
        """The blocks a failed forward was filling may hold nothing valid: no later request may
        match them, and one of this step that already did computes its prefix again."""
        for chunk, result in zip(chunks, results, strict=True):
            if isinstance(result, RowFault) and result.forward_failed and not chunk.seq.is_finished:
                for other in self.scheduler.discard_filled(chunk):
                    log.warning(
                        "%s shares blocks with failed %s: recomputed", other.request_id, chunk.seq.request_id
                    )

    def _fail_faulted(
        self, chunks: list[ScheduledSequence], results: list[ChunkResult]
    ) -> list[RequestOutput]:
        """End the requests the engine failed on, and only them."""
        outputs: list[RequestOutput] = []
        for chunk, result in zip(chunks, results, strict=True):
            seq = chunk.seq
            if not isinstance(result, RowFault) or seq.is_finished:
                continue
            req = self._requests.pop(seq.request_id)  # (what it filled: _discard_failed_fills)
            seq.error = result.reason
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
            final = final_output(req.seq, [], "")
            if result.invalid_field:  # the request's own constraint dead-ended, not the engine
                outputs.append(dataclasses.replace(final, invalid_field=result.invalid_field))
            else:
                outputs.append(dataclasses.replace(final, fault=True))
        return outputs

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence) -> tuple[SampledToken, ...]:
        """The prompt's logprobs, with the request's first token (and then never again)."""
        scored = seq.prompt_logprobs
        if scored is None:
            return ()
        seq.prompt_logprobs = None
        # Every prompt position was computed (no cached prefix) before a token could be drawn.
        return tuple(t for t in scored if t is not None)

    @staticmethod
    def _advance_guide(req: _Request, token: int, status: SequenceStatus | None) -> SequenceStatus | None:
        """Feed the token to the request's grammar: a complete grammar ends the request (STOP),
        also when it completes with the last token max_tokens allows: its output is whole, and
        LENGTH would tell the client it was cut (the SDKs' ``parse`` then refuses it)."""
        assert req.guide is not None
        refused = req.guide.advance(token)
        if refused:
            req.seq.error = refused
            return SequenceStatus.FINISHED_ERROR
        return SequenceStatus.FINISHED_STOPPED if req.guide.finished and status in _CUT_OR_GOING else status

    def _check_stop(self, req: _Request, token: int) -> SequenceStatus | None:
        seq = req.seq
        if token in req.stop_ids:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    # -- reporting -----------------------------------------------------------
    def load(self) -> EngineLoad:
        usage = self.block_manager.usage()
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        tokens = sum(n for _, n in self._recent)
        return EngineLoad(
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            kv_blocks_used=usage.used,
            kv_blocks_total=usage.total,
            kv_blocks_cached=usage.cached,
            tokens_per_second=tokens / THROUGHPUT_WINDOW_S,
            parked=len(self.scheduler.parked),
        )

    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes no request holds."""
        self.block_manager.reset_prefix_cache()
        self.block_manager.events.publish()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run ``prompts`` to completion together; returns each one's generated token ids."""
        ids = [f"generate-{i}-{random.getrandbits(32):08x}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, params)
        while any(rid in self._requests for rid in ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]


def _eos_ids(model: object, tokenizer: object) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(e for e in eos if isinstance(e, int))
    return frozenset(ids)
