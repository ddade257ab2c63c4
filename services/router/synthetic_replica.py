"""Synthetic token source: a fake `llmmesh.v1.Inference` replica for router load tests only.

It runs no model. Token ids come from a hash of the prompt and the token index,
so a generation resumed from any index continues exactly as the original would
(what router failover relies on), and it paces tokens at a configured rate and
time to first token. Failure injection (die after N tokens, refuse a share of
requests) exercises retries. Never a substitute for the real engine in serving.

    python -m services.router.synthetic_replica --port 0 --model-id synthetic
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from services.common import errors
from services.common.server import HealthReporter, run
from services.common.settings import EnvArgumentParser, add_server_args, server_options
from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc

log = logging.getLogger("llmmesh.synthetic")

VOCAB_SIZE = 49152
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class SyntheticConfig:
    """How the synthetic token source behaves."""

    model_id: str = "synthetic"
    #: Tokens per second per stream; 0 = as fast as possible.
    tokens_per_second: float = 0.0
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

    def __post_init__(self) -> None:
        if self.tokens_per_second < 0 or self.ttft_s < 0:
            raise ValueError("--tokens-per-second and --ttft-ms must be >= 0")
        if self.tokens_per_chunk < 1:
            raise ValueError("--tokens-per-chunk must be >= 1")
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError("--fail-rate must be in [0, 1]")
        if self.coalesce and not self.tokens_per_second:
            raise ValueError("--coalesce needs --tokens-per-second: unpaced tokens are always due")


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


class SyntheticInference(inference_pb2_grpc.InferenceServicer):
    """The Inference service, answering with synthetic tokens."""

    def __init__(self, config: SyntheticConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self._rng = rng or random.Random()
        self.running = 0
        self.tokens_sent = 0
        self.draining = False

    async def Generate(
        self,
        request_iterator: AsyncIterator[inference_pb2.GenerateRequest],
        context: grpc.aio.ServicerContext[inference_pb2.GenerateRequest, inference_pb2.GenerateResponse],
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("action") != "start":
            raise errors.InvalidArgument("start", "the first GenerateRequest must be `start`")
        start = first.start
        if self.config.log_requests:
            remaining = context.time_remaining()
            deadline = "none" if remaining is None or remaining > 1e6 else f"{remaining:.3f}"
            log.info("generate request_id=%s deadline_s=%s", start.request_id, deadline)
        if self.config.fail_rate and self._rng.random() < self.config.fail_rate:
            raise errors.DependencyUnavailable("synthetic failure injected (--fail-rate)")
        max_tokens = (
            start.sampling.max_tokens if start.sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        )
        if max_tokens < 1:
            raise errors.InvalidArgument("sampling.max_tokens", f"must be >= 1, got {max_tokens}")
        cancelled = asyncio.Event()

        async def watch_cancel() -> None:
            async for message in request_iterator:
                if message.WhichOneof("action") == "cancel":
                    cancelled.set()
                    return

        watcher = asyncio.create_task(watch_cancel())
        self.running += 1
        try:
            async for response in self._tokens(start, max_tokens, cancelled):
                yield response
        finally:
            self.running -= 1
            watcher.cancel()

    async def _tokens(
        self, start: inference_pb2.GenerateStart, max_tokens: int, cancelled: asyncio.Event
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        cfg = self.config
        arrived = time.perf_counter()
        key = prompt_key(start)
        index = len(start.resume_token_ids)
        if cfg.ttft_s:
            await asyncio.sleep(cfg.ttft_s)
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
                due = int((time.perf_counter() - first_at) * cfg.tokens_per_second) + 1
                n = max(n, min(due - generated, max_tokens - index))
            ids = [synthetic_token(key, index + i) for i in range(n)]
            yield inference_pb2.GenerateResponse(
                chunk=inference_pb2.TokenChunk(
                    text="".join(synthetic_text(t) for t in ids), token_ids=ids, index=index
                )
            )
            index += n
            generated += n
            self.tokens_sent += n
            if cfg.exit_after_tokens and self.tokens_sent >= cfg.exit_after_tokens:
                os._exit(1)  # failure injection: die like a kill -9, mid-stream
            if interval:
                next_at = first_at + generated / cfg.tokens_per_second if cfg.coalesce else next_at + interval
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # let other streams and the cancel watcher run
        done = time.perf_counter()
        yield inference_pb2.GenerateResponse(
            finished=inference_pb2.GenerationFinished(
                finish_reason=reason,
                usage=common_pb2.Usage(prompt_tokens=prompt_tokens(start), completion_tokens=generated),
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
            max_context_tokens=8192,
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

    async def close(self) -> None:
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = EnvArgumentParser(
        prog="python -m services.router.synthetic_replica",
        description="Synthetic token source (load testing only): a fake inference replica.",
    )
    add_server_args(parser, default_port=50062)
    parser.add_argument("--model-id", default="synthetic", help="model name it reports")
    parser.add_argument("--tokens-per-second", type=float, default=0.0, help="per stream; 0 = unpaced")
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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = SyntheticConfig(
        model_id=args.model_id,
        tokens_per_second=args.tokens_per_second,
        ttft_s=args.ttft_ms / 1000.0,
        tokens_per_chunk=args.tokens_per_chunk,
        coalesce=args.coalesce,
        exit_after_tokens=args.exit_after_tokens,
        fail_rate=args.fail_rate,
        log_requests=args.log_requests,
    )
    run(server_options("synthetic-replica", args), SyntheticRuntime(config))


if __name__ == "__main__":
    main()
