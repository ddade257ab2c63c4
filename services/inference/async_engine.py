"""Runs the engine loop in its own thread and streams each request's outputs to asyncio.

The event loop never waits on torch: requests and aborts are handed to the
engine thread through locked queues, and outputs come back with
``call_soon_threadsafe``. When idle, the engine thread sleeps on a condition.
A stream whose reader fell behind (its previous message still being written)
gets the outputs that piled up merged into one, as vLLM's output collector does:
the cost of a gRPC message, here and in the router, is per message, not per token.
A reader that stops taking outputs altogether (a client that does not read, a
generation the router paused) gets its sequence parked once ``PARK_AFTER_OUTPUTS``
(one of GenerateMany's flow limits, ``services/common/generate_many/limits.py``) wait for it: the engine stops computing it and gives its seat and KV blocks to
others until the reader takes what waits, instead of running it to max_tokens
into a queue nobody reads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass

from services.common import errors
from services.common.generate_many.limits import PARK_AFTER_OUTPUTS
from services.common.generate_many.merge import Span, merge
from services.inference import metrics
from services.inference.detokenizer import IncrementalDetokenizer
from services.inference.engine import THROUGHPUT_WINDOW_S, EngineFailure, EngineLoad, LLMEngine, RequestOutput
from services.inference.engine_thread import EngineThread
from services.inference.grammar import Guide
from services.inference.sampling import SamplingParams
from services.inference.sequence import FinishReason

log = logging.getLogger("llmmesh.inference.engine")

#: New output constraints (distinct ones) that may wait for the replica's one compiler thread.
#: A request whose constraint is among them waits for that compile and adds none, so this bounds
#: distinct grammars, not requests: the structured-output test sends 24 new ones in one batch,
#: and 32 of the slowest within the schema budget (0.4-0.65 s each, docs/inference.md) compile
#: in 13-21 s, inside the router's 60 s TTFT timeout; typical ones (1-20 ms) in under a second.
MAX_QUEUED_COMPILES = 32


@dataclass
class _Pending:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    resume_token_ids: Seq[int]
    sink: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    # Cancelled before the engine thread took it: the thread admits and aborts it at
    # once, so the stream still gets its CANCELLED final output (dropping the entry
    # here left the stream waiting forever).
    aborted: bool = False
    # Parked in the engine: its reader left PARK_AFTER_OUTPUTS outputs untaken (loop thread only).
    parked: bool = False
    # The engine holds nothing of it any more: refused by ``LLMEngine.enqueue``, or ended with
    # a status (a fault, an invalid field). Set by the engine thread before it posts that, so
    # the stream's end sends no abort: one would wait in the engine's queue and cancel the next
    # request that reuses the id (a retry).
    gone: bool = False
    # Its output constraint's matcher, compiled on an executor thread before it was handed over.
    guide: Guide | None = None
    # A resumed request's text state, its resumed tokens replayed on an executor thread.
    detokenizer: IncrementalDetokenizer | None = None
    # Its prompt blocks are shared only with requests of the same salt (kv_blocks.py).
    cache_salt: str = ""


@dataclass
class _Admission:
    """A request being prepared for the engine (its grammar, its resumed text), not yet handed over."""

    aborted: bool = False


def merge_outputs(outputs: Seq[RequestOutput]) -> RequestOutput:
    """One output for consecutive outputs of one request, by GenerateMany's one merge rule
    (``merge.merge``: all their tokens and text in order, at the first token's ``index``), that
    ends as the last output does (finished, reason, usage, timings)."""
    last = outputs[-1]
    if len(outputs) == 1:
        return last
    token_ids: list[int] = []
    index, text = merge([Span(o.index, o.new_token_ids, o.text) for o in outputs], token_ids)
    logprobs = tuple(lp for o in outputs for lp in o.logprobs)
    scored = tuple(lp for o in outputs for lp in o.prompt_logprobs)  # the first output's, if any
    return dataclasses.replace(
        last,
        new_token_ids=token_ids,
        text=text,
        index=index,
        logprobs=logprobs,
        prompt_logprobs=scored,
        prompt_tokens=max(o.prompt_tokens for o in outputs),  # the first output's, if among them
    )


class AsyncEngine:
    """Thread-backed front of ``LLMEngine`` for asyncio servicers."""

    def __init__(
        self,
        engine: LLMEngine,
        on_failure: Callable[[str], None] | None = None,
        thread: EngineThread | None = None,
    ) -> None:
        """``thread``: the thread that loaded and warmed ``engine`` (engine_thread.py says why
        its loop should run there too); a new one when not given. Either way it is this
        object's from now on, and ``close`` ends it."""
        self.engine = engine
        #: Called (from the engine thread) once the engine itself has failed: the replica stops serving.
        self._on_failure = on_failure
        #: Why the engine failed (out of memory, device lost), once it has: it takes no more work.
        self.failure: str | None = None
        self._cond = threading.Condition()
        self._pending: list[_Pending] = []
        self._sinks: dict[str, _Pending] = {}
        # Requests being prepared (``generate`` before the handover), by id.
        self._admitting: dict[str, _Admission] = {}
        self._stopped = False
        self.draining = False
        self._load = engine.load()
        self._load_at = time.monotonic()
        self._preemptions_seen = 0
        #: New grammars compile here, one at a time, not on the default executor that prepares
        #: every request: a schema that takes seconds to compile held all of its threads, and
        #: requests with no constraint (bad words, a resume) waited 46 s behind six of them.
        #: A copy of a compiled grammar stays on the default executor.
        self._grammar_compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        #: The new grammars queued on (or compiling on) that thread: how many requests wait for
        #: each (loop thread only). Past ``MAX_QUEUED_COMPILES`` a new one is refused at once.
        self._compiling: dict[tuple[str, str, tuple[str, ...]], int] = {}
        self._thread = thread or EngineThread()
        self._loop_done = self._thread.submit(self._run)
        self._loop_done.add_done_callback(_report_loop_end)

    # -- asyncio side ----------------------------------------------------------
    def load(self) -> EngineLoad:
        """The load as of the last engine step (never blocks on the engine). An idle engine
        takes no steps: once its last one is a throughput window old, it made no tokens in
        the window (its last figure was reported for ever, "8 tok/s" after minutes idle)."""
        load = self._load
        if load.tokens_per_second and time.monotonic() - self._load_at > THROUGHPUT_WINDOW_S:
            return dataclasses.replace(load, tokens_per_second=0.0)
        return load

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume_token_ids: Seq[int] = (),
        prompt_field: str = "prompt",
        cache_salt: str = "",
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs; leaving early (cancel, error, client gone) aborts it.

        ``prompt_field``: the request's name for its prompt, for the refusals that name it.
        ``cache_salt``: its cached prompt blocks are shared only with requests of the same salt.
        """
        if self.draining:
            raise errors.DependencyUnavailable("replica is shutting down; send work elsewhere")
        if self.failure is not None:
            raise errors.DependencyUnavailable(
                f"the inference engine failed ({self.failure}); send work elsewhere"
            )
        # Refused before anything else sees it (the grammar would overflow on token ids outside
        # the vocabulary); touches no state, so no lock.
        self.engine.validate(prompt_token_ids, params, resume_token_ids, prompt_field)
        with self._cond:
            if request_id in self._sinks or request_id in self._admitting:
                raise errors.AlreadyExists(f"request {request_id!r} is already running")
            # Known from here on: a cancel while it is being prepared (a grammar compiling, a
            # long resume replayed: seconds at worst) is kept for the handover, not lost.
            admission = self._admitting[request_id] = _Admission()
        try:
            # The constraint compiles (or comes from the cache) on an executor thread, before the
            # request is handed over: a compile never holds up a step, and a bad one is refused here.
            guide = None
            if params.constraint is not None:
                if self.engine.grammar_compiled(params):
                    guide = await asyncio.get_running_loop().run_in_executor(
                        None, self.engine.make_guide, params, resume_token_ids
                    )
                else:
                    guide = await self._compile_guide(params, resume_token_ids)
            if params.bad_words:  # tokenized here, not on the engine thread that steps every request
                params = await asyncio.to_thread(self.engine.with_bad_word_ids, params)
            detokenizer = None
            if resume_token_ids:  # its resumed tokens are decoded again: not on the engine thread either
                detokenizer = await asyncio.to_thread(self.engine.make_detokenizer, params, resume_token_ids)
        except BaseException:
            with self._cond:
                self._admitting.pop(request_id, None)
            raise
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        pending = _Pending(
            request_id,
            prompt_token_ids,
            params,
            resume_token_ids,
            sink,
            asyncio.get_running_loop(),
            guide=guide,
            detokenizer=detokenizer,
            cache_salt=cache_salt,
        )
        with self._cond:
            self._admitting.pop(request_id, None)
            # Cancelled while it was prepared: handed over all the same, so the engine thread
            # admits and aborts it at once and the stream gets its CANCELLED final output.
            pending.aborted = admission.aborted
            # The queue bound, here on arrival: a surplus request is refused at once, not after
            # the step the engine thread is in (which can take seconds). Queued = handed over
            # but not yet taken + the engine's waiting queue as last published.
            self.engine.check_room(waiting=len(self._pending) + self._load.waiting)
            self._pending.append(pending)
            self._sinks[request_id] = pending
            self._cond.notify()
        finished = False
        last_token_at: float | None = None
        failure: BaseException | None = None
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                if not item.finished and not sink.empty():
                    # The reader was busy (its last message still being written): send what piled up as one.
                    batch = [item]
                    while not item.finished and not sink.empty():
                        queued = sink.get_nowait()
                        if isinstance(queued, BaseException):
                            failure = queued  # raised once the tokens before it are out
                            break
                        batch.append(queued)
                        item = queued
                    item = merge_outputs(batch)
                if pending.parked and sink.empty():
                    self._unpark(pending)  # the reader is back: compute it again while this goes out
                if item.new_token_ids:
                    now = time.monotonic()
                    if last_token_at is not None:
                        metrics.INTER_TOKEN_LATENCY.observe(now - last_token_at)
                    last_token_at = now
                yield item
                if item.finished:
                    finished = True
                    return
                if failure is not None:
                    raise failure
        finally:
            if not finished and not pending.gone:
                self.abort(request_id)

    async def _compile_guide(self, params: SamplingParams, resume_token_ids: Seq[int]) -> Guide | None:
        """``make_guide`` for a constraint not compiled yet, on the one compiler thread.

        A constraint already queued there adds no new grammar (its request's copy follows that
        compile); a new one while ``MAX_QUEUED_COMPILES`` are queued is refused at once with
        ``Overloaded`` (RESOURCE_EXHAUSTED, retry-after): the queue had no bound, and a client
        sending new schemas faster than they compiled made every later one wait minutes. A
        compile counts until the thread is done with it (or drops it unstarted), not until its
        request leaves: a client that cancels does not take its compile off the queue.
        """
        assert params.constraint is not None
        key = params.constraint.key
        if key not in self._compiling and len(self._compiling) >= MAX_QUEUED_COMPILES:
            raise errors.Overloaded(
                f"{len(self._compiling)} new output constraints are waiting to compile on this "
                "replica; retry later",
                retry_after_s=1.0,
            )
        loop = asyncio.get_running_loop()
        work = self._grammar_compiler.submit(self.engine.make_guide, params, resume_token_ids)
        self._compiling[key] = self._compiling.get(key, 0) + 1

        def compiled(_: Future[Guide | None]) -> None:  # on the compiler thread, or a canceller's
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody counts any more
                loop.call_soon_threadsafe(self._compile_done, key)

        work.add_done_callback(compiled)
        return await asyncio.wrap_future(work)

    def _compile_done(self, key: tuple[str, str, tuple[str, ...]]) -> None:
        left = self._compiling.pop(key, 1) - 1
        if left:
            self._compiling[key] = left

    def _arrive(self, pending: _Pending, out: RequestOutput) -> None:
        """An output reaches its stream (loop thread); a stream nobody reads gets its sequence parked."""
        sink = pending.sink
        sink.put_nowait(out)
        if not pending.parked and not out.finished and sink.qsize() >= PARK_AFTER_OUTPUTS:
            pending.parked = True
            self.engine.park_request(pending.request_id)

    def _unpark(self, pending: _Pending) -> None:
        pending.parked = False
        with self._cond:
            self.engine.unpark_request(pending.request_id)
            self._cond.notify()  # the engine thread sleeps when only parked sequences are left

    def abort(self, request_id: str) -> None:
        with self._cond:
            if (admission := self._admitting.get(request_id)) is not None:
                admission.aborted = True
                return
            for p in self._pending:
                if p.request_id == request_id:
                    p.aborted = True
                    self._cond.notify()
                    return
            self.engine.abort_request(request_id)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.stop(timeout_s=30)
        self._grammar_compiler.shutdown(wait=False, cancel_futures=True)

    # -- engine thread ---------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._stopped or self._pending or engine.has_unfinished_requests()):
                    self._cond.wait()
                if self._stopped:
                    break
                pending, self._pending = self._pending, []
            for p in pending:
                try:
                    engine.enqueue(
                        p.request_id,
                        p.prompt_token_ids,
                        p.params,
                        p.resume_token_ids,
                        guide=p.guide,
                        detokenizer=p.detokenizer,
                        cache_salt=p.cache_salt,
                    )
                    if p.aborted:
                        engine.abort_request(p.request_id)
                except Exception as exc:  # refused as it was queued (AlreadyExists): that caller only
                    self._forget(p.request_id)
                    p.gone = True  # before the caller can see the refusal, so it aborts nothing
                    p.loop.call_soon_threadsafe(p.sink.put_nowait, exc)
            try:
                outputs = engine.step()
            except EngineFailure as failure:
                # Not one request's fault (those the engine ends alone): the device or the
                # process is gone, so every request fails and the replica stops serving.
                log.exception("the inference engine failed; failing every request in flight")
                self.failure = str(failure)
                if self._on_failure is not None:  # stop serving before the clients hear of it
                    self._on_failure(self.failure)
                self._fail_all(engine)
                continue
            except Exception:
                log.exception("engine step failed; failing every request in flight")
                self._fail_all(engine)
                continue
            for out in outputs:
                self._deliver(out)
            self._publish_load()
        self._fail_all(engine)

    def _deliver(self, out: RequestOutput) -> None:
        with self._cond:
            target = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
        if out.finished:
            _record_finished(out)
        if target is None:
            return
        if out.invalid_field or out.fault:
            target.gone = True  # ended in the engine: the stream's end must abort nothing
        if out.invalid_field:
            # The request's own constraint cannot go on: INVALID_ARGUMENT naming it, as any
            # replica would end it (a router passes it on rather than failing over).
            invalid = errors.InvalidArgument(out.invalid_field, out.error)
            target.loop.call_soon_threadsafe(target.sink.put_nowait, invalid)
            return
        if out.fault:
            # The engine failed on this request alone: its stream ends with that status.
            fault = errors.RequestFault(f"request {out.request_id} failed in the engine: {out.error}")
            target.loop.call_soon_threadsafe(target.sink.put_nowait, fault)
            return
        target.loop.call_soon_threadsafe(self._arrive, target, out)

    def _forget(self, request_id: str) -> None:
        with self._cond:
            self._sinks.pop(request_id, None)

    def _fail_all(self, engine: LLMEngine) -> None:
        with self._cond:
            sinks, self._sinks = self._sinks, {}
        for rid, target in sinks.items():
            engine.abort_request(rid)
            target.gone = True  # aborted here: the stream's end must not abort the id again
            target.loop.call_soon_threadsafe(
                target.sink.put_nowait, errors.DependencyUnavailable("the inference engine failed")
            )
        try:
            engine.step()
        except Exception:
            log.exception("engine could not release aborted requests")
        finally:
            # A failed step may have offered blocks it never filled (in-step prefix sharing).
            engine.reset_prefix_cache()
        self._publish_load()

    def _publish_load(self) -> None:
        load = self.engine.load()
        self._load, self._load_at = load, time.monotonic()
        metrics.QUEUE_DEPTH.set(load.waiting)
        metrics.RUNNING_BATCH.set(load.running)
        metrics.PARKED.set(load.parked)
        metrics.KV_CACHE_USAGE.set(load.kv_blocks_used / max(1, load.kv_blocks_total))
        preemptions = self.engine.num_preemptions
        if preemptions > self._preemptions_seen:
            metrics.PREEMPTIONS.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions


def _report_loop_end(done: Future[None]) -> None:
    """The loop ends only when closed; anything else it raised is logged, not lost in its future."""
    if not done.cancelled() and (exc := done.exception()) is not None:
        log.error("the engine loop ended unexpectedly", exc_info=exc)


def _record_finished(out: RequestOutput) -> None:
    reason = out.finish_reason or FinishReason.ERROR
    metrics.REQUESTS.labels(reason.value).inc()
    if out.usage is not None:
        metrics.PROMPT_TOKENS.inc(out.usage.prompt_tokens)
        metrics.GENERATION_TOKENS.inc(out.usage.completion_tokens)
        metrics.PREFIX_CACHE_HIT_TOKENS.inc(out.usage.cached_prompt_tokens)
    if out.timings is not None:
        if out.timings.ttft_ms > 0:
            metrics.TIME_TO_FIRST_TOKEN.observe(out.timings.ttft_ms / 1000.0)
        metrics.E2E_LATENCY.observe(out.timings.total_ms / 1000.0)
