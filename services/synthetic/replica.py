"""Synthetic token source: a fake `llmmesh.v1.Inference` replica for router load tests only.

It runs no model. Token ids come from a hash of the prompt and the token index,
so a generation resumed from any index continues exactly as the original would
(what router failover relies on), and it paces tokens at a configured rate and
time to first token. Failure injection (die after N tokens, refuse a share of
requests) exercises retries. Never a substitute for the real engine in serving.

    python -m services.synthetic --port 0 --model-id synthetic
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from services.common import errors
from services.common.server import HealthReporter, run
from services.common.settings import EnvArgumentParser, add_server_args, server_options
from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.inference.multiplex import serve_many

log = logging.getLogger("llmmesh.synthetic")

VOCAB_SIZE = 49152
Message = TypeVar("Message", inference_pb2.GenerateResponse, inference_pb2.GenerationEvent)
DEFAULT_MAX_TOKENS = 16
#: The context it claims in ModelInfo by default (the engine's cap), and holds generations to.
MAX_CONTEXT_TOKENS = 8192


@dataclass(frozen=True)
class SyntheticConfig:
    """How the synthetic token source behaves."""

    model_id: str = "synthetic"
    #: Tokens per second per stream; 0 = as fast as possible.
    tokens_per_second: float = 0.0
    #: Engine-like pacing: every running stream gets its next chunk at the same step boundary, every
    #: ``step_s`` seconds, as a continuous-batching engine emits one token per sequence per step.
    #: 0 = off (streams paced on their own by ``tokens_per_second``).
    step_s: float = 0.0
    #: Delay before the first token, seconds.
    ttft_s: float = 0.0
    #: Tokens sent per chunk message.
    tokens_per_chunk: int = 1
    #: Paced tokens that fell due while the previous message was still being written go out
    #: as one chunk, as the inference servicer sends them (needs ``tokens_per_second``).
    coalesce: bool = False
    #: Kill the whole process (os._exit) once this many tokens were sent in all; 0 = never.
    exit_after_tokens: int = 0
    #: Share of Generate calls refused with UNAVAILABLE before any token.
    fail_rate: float = 0.0
    #: Waiting-queue bound reported in GetLoad.
    max_queued_requests: int = 256
    #: Log each generation's request id and the deadline it arrived with (tests check propagation).
    log_requests: bool = False
    #: The context it advertises: prompt + max_tokens beyond it is INVALID_ARGUMENT, as on the engine.
    max_context_tokens: int = MAX_CONTEXT_TOKENS
    #: Prompt tokens it reports as read from a prefix cache (at most the prompt), so tests can
    #: follow the third usage field; 0 = none, as an engine with a cold prefix cache.
    cached_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if self.tokens_per_second < 0 or self.ttft_s < 0 or self.step_s < 0:
            raise ValueError("--tokens-per-second, --ttft-ms and --step-ms must be >= 0")
        if self.step_s and self.tokens_per_second:
            raise ValueError("--step-ms and --tokens-per-second are two pacings: choose one")
        if self.tokens_per_chunk < 1:
            raise ValueError("--tokens-per-chunk must be >= 1")
        if self.max_context_tokens < 2:
            raise ValueError("--max-context-tokens must be >= 2 (a prompt token and an answer token)")
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError("--fail-rate must be in [0, 1]")
        if self.cached_prompt_tokens < 0:
            raise ValueError("--cached-prompt-tokens must be >= 0")
        if self.coalesce and not (self.tokens_per_second or self.step_s):
            raise ValueError(
                "--coalesce needs --tokens-per-second or --step-ms: unpaced tokens are always due"
            )


def prompt_key(start: inference_pb2.GenerateStart) -> bytes:
    """What the token stream depends on: the prompt and the sampling seed."""
    text = start.prompt or "\n".join(f"{m.role}:{m.content}" for m in start.messages)
    seed = start.sampling.seed if start.sampling.HasField("seed") else 0
    return hashlib.blake2b(f"{seed}|{text}".encode(), digest_size=16).digest()


def synthetic_token(key: bytes, index: int) -> int:
    """Token ``index`` of the answer to ``key``: the same on every replica, for any resume point."""
    digest = hashlib.blake2b(index.to_bytes(4, "big"), key=key, digest_size=4).digest()
    return int.from_bytes(digest, "big") % VOCAB_SIZE


def synthetic_text(token_id: int) -> str:
    return f" t{token_id}"


def prompt_tokens(start: inference_pb2.GenerateStart) -> int:
    # A rough count (4 characters a token) so usage looks plausible.
    chars = len(start.prompt) + sum(len(m.content) + 4 for m in start.messages)
    return max(1, chars // 4)


class StepClock:
    """One step boundary shared by every stream of a replica, like an engine's decode step.

    A continuous-batching engine produces one token for each running sequence
    per step, so its streams get their tokens at the same moment; this clock
    wakes all waiting streams at once on a grid of ``step_s``. The timer runs
    only while some stream waits.
    """

    def __init__(self, step_s: float) -> None:
        if step_s <= 0:
            raise ValueError("step_s must be > 0")
        self.step_s = step_s
        #: The number of the step that fired last (steps are numbered from the loop clock's zero).
        self.step = 0
        self._tick = asyncio.Event()
        self._armed = False

    async def next_step(self) -> None:
        """Return at the next step boundary."""
        if not self._armed:
            loop = asyncio.get_running_loop()
            upcoming = int(loop.time() / self.step_s) + 1
            loop.call_at(upcoming * self.step_s, self._fire, upcoming)
            self._armed = True
        await self._tick.wait()

    def _fire(self, step: int) -> None:
        self._armed = False
        self.step = step
        self._tick.set()  # wakes every stream waiting now ...
        self._tick.clear()  # ... and none that starts waiting after


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
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("action") != "start":
            raise errors.InvalidArgument("start", "the first GenerateRequest must be `start`")
        start = first.start
        remaining = context.time_remaining()
        max_tokens = self._admit(start, None if remaining is None or remaining > 1e6 else remaining)
        cancelled = asyncio.Event()

        async def watch_cancel() -> None:
            async for message in request_iterator:
                if message.WhichOneof("action") == "cancel":
                    cancelled.set()
                    return

        watcher = asyncio.create_task(watch_cancel())
        self.running += 1
        try:
            async for response in self._tokens(start, max_tokens, cancelled, inference_pb2.GenerateResponse):
                yield response
        finally:
            self.running -= 1
            watcher.cancel()

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
        """One generation on a GenerateMany stream (``GenerationBackend``)."""
        max_tokens = self._admit(start, timeout_s or None)
        cancelled = self._cancels[start.request_id] = asyncio.Event()
        self.running += 1
        try:
            async for event in self._tokens(start, max_tokens, cancelled, inference_pb2.GenerationEvent):
                yield event
        finally:
            self.running -= 1
            self._cancels.pop(start.request_id, None)

    def cancel(self, request_id: str) -> None:
        """``GenerationBackend``: a GenerateMany `cancel`."""
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
        max_tokens = (
            start.sampling.max_tokens if start.sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        )
        if max_tokens < 1:
            raise errors.InvalidArgument("sampling.max_tokens", f"must be >= 1, got {max_tokens}")
        context = self.config.max_context_tokens
        if (prompt := prompt_tokens(start)) + max_tokens > context:
            # Without this a huge max_tokens streams until the client's deadline (the fuzzer found it).
            raise errors.InvalidArgument(
                "max_tokens", f"{max_tokens} plus {prompt} prompt tokens exceed the {context}-token context"
            )
        return max_tokens

    async def _tokens(
        self,
        start: inference_pb2.GenerateStart,
        max_tokens: int,
        cancelled: asyncio.Event,
        message: type[Message],
    ) -> AsyncIterator[Message]:
        """The answer as ``message``s (GenerateResponse or GenerationEvent: both have `chunk` and `finished`)."""
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
            yield message(
                chunk=inference_pb2.TokenChunk(
                    text="".join(synthetic_text(t) for t in ids), token_ids=ids, index=index
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
        yield message(
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = EnvArgumentParser(
        prog="python -m services.synthetic",
        description="Synthetic token source (load testing only): a fake inference replica.",
    )
    add_server_args(parser, default_port=50062)
    parser.add_argument("--model-id", default="synthetic", help="model name it reports")
    parser.add_argument("--tokens-per-second", type=float, default=0.0, help="per stream; 0 = unpaced")
    parser.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="engine-like pacing: all streams get their next chunk at the same step, this often (0 = off)",
    )
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token")
    parser.add_argument("--tokens-per-chunk", type=int, default=1, help="tokens per chunk message")
    parser.add_argument(
        "--coalesce",
        action="store_true",
        help="send the paced tokens that fell due during the previous write as one chunk (as the engine does)",
    )
    parser.add_argument(
        "--exit-after-tokens", type=int, default=0, help="die after this many tokens (0 = never)"
    )
    parser.add_argument(
        "--fail-rate", type=float, default=0.0, help="share of calls refused with UNAVAILABLE"
    )
    parser.add_argument("--log-requests", action="store_true", help="log each request id and its deadline")
    parser.add_argument(
        "--max-context-tokens",
        type=int,
        default=MAX_CONTEXT_TOKENS,
        help="context it advertises; longer generations are refused with INVALID_ARGUMENT",
    )
    parser.add_argument(
        "--cached-prompt-tokens",
        type=int,
        default=0,
        help="prompt tokens reported as prefix-cache hits (at most the prompt)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = SyntheticConfig(
        model_id=args.model_id,
        tokens_per_second=args.tokens_per_second,
        step_s=args.step_ms / 1000.0,
        ttft_s=args.ttft_ms / 1000.0,
        tokens_per_chunk=args.tokens_per_chunk,
        coalesce=args.coalesce,
        exit_after_tokens=args.exit_after_tokens,
        fail_rate=args.fail_rate,
        log_requests=args.log_requests,
        max_context_tokens=args.max_context_tokens,
        cached_prompt_tokens=args.cached_prompt_tokens,
    )
    run(server_options("synthetic-replica", args), SyntheticRuntime(config))


if __name__ == "__main__":
    main()
