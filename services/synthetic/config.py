"""How the synthetic token source behaves: its settings and the command-line flags that set them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.settings import EnvArgumentParser, add_server_args

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


def config_from_args(args: argparse.Namespace) -> SyntheticConfig:
    return SyntheticConfig(
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
