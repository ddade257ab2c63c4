"""Synthetic token source: a fake `llmmesh.v1.Inference` replica for router load tests only.

It runs no model. Token ids come from a hash of the prompt and the token index,
so a generation resumed from any index continues exactly as the original would
(what router failover relies on), and it paces tokens at a configured rate and
time to first token. Failure injection (die after N tokens, refuse a share of
requests) exercises retries. Never a substitute for the real engine in serving.

    python -m services.synthetic --port 0 --model-id synthetic
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import grpc

from services.common import errors
from services.common.generate_many.server import serve_many, serve_one
from services.common.server import HealthReporter, run
from services.common.settings import server_options
from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.synthetic.config import DEFAULT_MAX_TOKENS, SyntheticConfig, config_from_args, parse_args
from services.synthetic.tokens import (
    VOCAB_SIZE,
    StepClock,
    prompt_key,
    prompt_tokens,
    synthetic_text,
    synthetic_token,
)

log = logging.getLogger("llmmesh.synthetic")


class SyntheticInference(inference_pb2_grpc.InferenceServicer):
    """The Inference service, answering with synthetic tokens."""

    def __init__(self, config: SyntheticConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self._rng = rng or random.Random()
        self.running = 0
        self.tokens_sent = 0
        self.draining = False
        self.steps = StepClock(config.step_s) if config.step_s else None
        #: Set when the replica drains: GenerateMany streams end once their generations have.
        self.stopping = asyncio.Event()
        #: request id → cancel flag of each generation running on a GenerateMany stream.
        self._cancels: dict[str, asyncio.Event] = {}

    async def Generate(
        self,
        request_iterator: AsyncIterator[inference_pb2.GenerateRequest],
        context: grpc.aio.ServicerContext[inference_pb2.GenerateRequest, inference_pb2.GenerateResponse],
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        # The same generation as on a GenerateMany stream, through the shared server half.
        async for response in serve_one(self, request_iterator, context):
            yield response

    async def GenerateMany(
        self,
        request_iterator: AsyncIterator[inference_pb2.GenerateManyRequest],
        context: grpc.aio.ServicerContext[
            inference_pb2.GenerateManyRequest, inference_pb2.GenerateManyResponse
        ],
    ) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
        async for response in serve_many(self, request_iterator, self.stopping):
            yield response

    async def generate(
        self, start: inference_pb2.GenerateStart, timeout_s: float
    ) -> AsyncGenerator[inference_pb2.GenerationEvent, None]:
        """One generation, on a GenerateMany stream or a Generate call (``GenerationBackend``)."""
        max_tokens = self._admit(start, timeout_s or None)
        cancelled = self._cancels[start.request_id] = asyncio.Event()
        self.running += 1
        try:
            async for event in self._tokens(start, max_tokens, cancelled):
                yield event
        finally:
            self.running -= 1
            if self._cancels.get(start.request_id) is cancelled:  # a direct client may reuse an id
                del self._cancels[start.request_id]

    def cancel(self, request_id: str) -> None:
        """``GenerationBackend``: a `cancel` on either RPC."""
        if (cancelled := self._cancels.get(request_id)) is not None:
            cancelled.set()

    def _admit(self, start: inference_pb2.GenerateStart, deadline_s: float | None) -> int:
        """Log, refuse while draining, inject failures, validate: the generation's max_tokens."""
        if self.config.log_requests:
            deadline = "none" if deadline_s is None else f"{deadline_s:.3f}"
            log.info("generate request_id=%s deadline_s=%s", start.request_id, deadline)
        if self.draining:
            raise errors.DependencyUnavailable("replica is shutting down; send work elsewhere")
        if self.config.fail_rate and self._rng.random() < self.config.fail_rate:
            raise errors.DependencyUnavailable("synthetic failure injected (--fail-rate)")
        context = self.config.max_context_tokens
        if start.sampling.HasField("max_tokens"):
            max_tokens = start.sampling.max_tokens
        elif start.sampling.max_tokens_to_context:  # as the engine: all the context leaves
            max_tokens = max(1, context - prompt_tokens(start))
        else:
            max_tokens = DEFAULT_MAX_TOKENS
        if max_tokens < 1:
            raise errors.InvalidArgument("sampling.max_tokens", f"must be >= 1, got {max_tokens}")
        if (prompt := prompt_tokens(start)) + max_tokens > context:
            # Without this a huge max_tokens streams until the client's deadline (the fuzzer found it).
            raise errors.ContextTooLong(
                "max_tokens", f"{max_tokens} plus {prompt} prompt tokens exceed", context
            )
        return max_tokens

    async def _tokens(
        self,
        start: inference_pb2.GenerateStart,
        max_tokens: int,
        cancelled: asyncio.Event,
    ) -> AsyncIterator[inference_pb2.GenerationEvent]:
        """The answer's events: its chunks, paced as configured, then ``finished``."""
        cfg = self.config
        arrived = time.perf_counter()
        key = prompt_key(start)
        index = len(start.resume_token_ids)
        if cfg.ttft_s:
            await asyncio.sleep(cfg.ttft_s)
        steps = self.steps
        if steps is not None:
            await steps.next_step()  # the first token comes out of a step too
        first_step = steps.step if steps is not None else 0
        first_at = time.perf_counter()
        interval = cfg.tokens_per_chunk / cfg.tokens_per_second if cfg.tokens_per_second else 0.0
        next_at = first_at
        generated = 0
        reason = common_pb2.FINISH_REASON_LENGTH
        while index < max_tokens:
            if cancelled.is_set():
                reason = common_pb2.FINISH_REASON_CANCELLED
                break
            n = min(cfg.tokens_per_chunk, max_tokens - index)
            if cfg.coalesce:
                # Every token due by now: an engine keeps generating while the last write is in flight.
                if steps is not None:
                    due = (steps.step - first_step + 1) * cfg.tokens_per_chunk
                else:
                    due = int((time.perf_counter() - first_at) * cfg.tokens_per_second) + 1
                n = max(n, min(due - generated, max_tokens - index))
            ids = [synthetic_token(key, index + i) for i in range(n)]
            yield inference_pb2.GenerationEvent(
                chunk=inference_pb2.TokenChunk(
                    text="".join(synthetic_text(t) for t in ids),
                    token_ids=ids,
                    index=index,
                    # In the first chunk only, as a replica says it (inference.proto).
                    prompt_tokens=prompt_tokens(start) if generated == 0 else 0,
                )
            )
            index += n
            generated += n
            self.tokens_sent += n
            if cfg.exit_after_tokens and self.tokens_sent >= cfg.exit_after_tokens:
                os._exit(1)  # failure injection: die like a kill -9, mid-stream
            if index >= max_tokens:
                break  # `finished` comes with the last token, as the engine's last step ends the sequence
            if steps is not None:
                await steps.next_step()
            elif interval:
                next_at = first_at + generated / cfg.tokens_per_second if cfg.coalesce else next_at + interval
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # let other streams and the cancel watcher run
        done = time.perf_counter()
        yield inference_pb2.GenerationEvent(
            finished=inference_pb2.GenerationFinished(
                finish_reason=reason,
                usage=common_pb2.Usage(
                    prompt_tokens=prompt_tokens(start),
                    completion_tokens=generated,
                    cached_prompt_tokens=min(cfg.cached_prompt_tokens, prompt_tokens(start)),
                ),
                timings=common_pb2.Timings(
                    ttft_ms=(first_at - arrived) * 1000,
                    decode_ms=(done - first_at) * 1000,
                    total_ms=(done - arrived) * 1000,
                ),
            )
        )

    async def GetLoad(
        self,
        request: inference_pb2.GetLoadRequest,
        context: grpc.aio.ServicerContext[inference_pb2.GetLoadRequest, inference_pb2.LoadReport],
    ) -> inference_pb2.LoadReport:
        return inference_pb2.LoadReport(
            running=self.running,
            max_queued_requests=self.config.max_queued_requests,
            draining=self.draining,
        )

    async def GetModelInfo(
        self,
        request: inference_pb2.GetModelInfoRequest,
        context: grpc.aio.ServicerContext[inference_pb2.GetModelInfoRequest, inference_pb2.ModelInfo],
    ) -> inference_pb2.ModelInfo:
        return inference_pb2.ModelInfo(
            model_id=self.config.model_id,
            max_context_tokens=self.config.max_context_tokens,
            dtype="float32",
            device="synthetic",
            vocab_size=VOCAB_SIZE,
        )

    async def WatchKvEvents(
        self,
        request: inference_pb2.WatchKvEventsRequest,
        context: grpc.aio.ServicerContext[inference_pb2.WatchKvEventsRequest, inference_pb2.KvEvents],
    ) -> AsyncIterator[inference_pb2.KvEvents]:
        # No KV cache to describe: it answers as a replica older than the RPC does, so a
        # router keeps it in approximate prefix mode (and tests can exercise that path).
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the synthetic replica keeps no KV cache")
        yield inference_pb2.KvEvents()  # pragma: no cover - abort raises; this makes it a stream


class SyntheticRuntime:
    """ServiceRuntime for the synthetic token source."""

    service_names: Sequence[str] = ("llmmesh.v1.Inference",)

    def __init__(self, config: SyntheticConfig) -> None:
        self.servicer = SyntheticInference(config)

    def register(self, server: grpc.aio.Server) -> None:
        inference_pb2_grpc.add_InferenceServicer_to_server(self.servicer, server)

    async def start(self, health: HealthReporter) -> None:
        await health.set_serving(True)

    async def drain(self) -> None:
        self.servicer.draining = True
        self.servicer.stopping.set()

    async def close(self) -> None:
        return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        options = server_options("synthetic-replica", args)
    except ValueError as exc:
        # One line and exit 2, as argparse's own usage errors (a bad --tls-cert was a traceback).
        print(f"python -m services.synthetic: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    run(options, SyntheticRuntime(config_from_args(args)))


if __name__ == "__main__":
    main()
