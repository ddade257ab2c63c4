"""Sampling parameters of one request, validated once at the door."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.errors import InvalidArgument

#: Temperatures below this sample as greedy (argmax), as vLLM's ``_SAMPLING_EPS`` does: dividing
#: logits by a temperature like 1e-40 overflows float32 to inf, and the softmax of inf is NaN.
MIN_TEMPERATURE = 1e-5
#: Repetition penalties outside [1/100, 100] are refused: a penalty of 1e-45 multiplies a logit
#: into inf (NaN probabilities), and past 100 the penalty is already absolute in practice.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn for one request; invalid values raise ``InvalidArgument``."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidArgument("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if math.isnan(self.temperature) or math.isinf(self.temperature) or self.temperature < 0:
            raise InvalidArgument("temperature", f"must be finite and >= 0, got {self.temperature}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        # The slack admits the bounds as float32 carries them (0.01 arrives as 0.0099999998); NaN fails.
        if (
            not MIN_REPETITION_PENALTY * (1 - 1e-6)
            <= self.repetition_penalty
            <= MAX_REPETITION_PENALTY * (1 + 1e-6)
        ):
            raise InvalidArgument(
                "repetition_penalty",
                f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] (1 = off), "
                f"got {self.repetition_penalty}",
            )
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidArgument("seed", f"must fit in 64 unsigned bits, got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop", "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or below ``MIN_TEMPERATURE``) means argmax: no randomness, no seed needed."""
        return self.temperature < MIN_TEMPERATURE
