"""Sampling parameters of one request, validated once at the door."""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.common.sampling_limits import (
    MAX_ABS_ADDITIVE_PENALTY,
    MAX_ABS_LOGIT_BIAS,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

#: Temperatures below this sample as greedy (argmax), as vLLM's ``_SAMPLING_EPS`` does: dividing
#: logits by a temperature like 1e-40 overflows float32 to inf, and the softmax of inf is NaN.
MIN_TEMPERATURE = 1e-5
#: Repetition penalties outside [1/100, 100] are refused: a penalty of 1e-45 multiplies a logit
#: into inf (NaN probabilities), and past 100 the penalty is already absolute in practice.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
#: The most alternatives a token's logprobs may list (OpenAI's limit too).
MAX_TOP_LOGPROBS = 20


class ConstraintKind(enum.StrEnum):
    """What an output constraint is written in; the value is the proto field that carries it."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"
    CHOICE = "choice"


@dataclass(frozen=True)
class Constraint:
    """What the output must match. ``spec`` is the schema, regex or grammar text (empty for
    ``json_object``); ``choices`` the alternatives of ``choice``. Only the shape is checked here:
    whether the text compiles is the grammar compiler's answer (``grammar.py``), at admission."""

    kind: ConstraintKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        field = self.kind.value
        if self.kind is ConstraintKind.CHOICE:
            if not self.choices:
                raise InvalidArgument(field, "needs at least one value")
            if len(self.choices) > MAX_CHOICES:
                raise InvalidArgument(field, f"at most {MAX_CHOICES} values, got {len(self.choices)}")
            if any(not c for c in self.choices):
                raise InvalidArgument(field, "values must not be empty")
        elif self.kind is not ConstraintKind.JSON_OBJECT and not self.spec.strip():
            raise InvalidArgument(field, "must not be empty")

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What identifies the compiled grammar (the compile cache's key)."""
        return (self.kind.value, self.spec, self.choices)


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
    #: What the output must match; None = free text.
    constraint: Constraint | None = None
    #: Return each generated token's log probability.
    logprobs: bool = False
    #: Also return this many most likely alternatives per token (0 to ``MAX_TOP_LOGPROBS``).
    top_logprobs: int = 0
    #: Return every prompt token's log probability (the first's NaN: nothing precedes it), with
    #: this many alternatives each (0 to ``MAX_TOP_LOGPROBS``); None = none. The whole prompt is
    #: then computed: no cached prefix is reused.
    prompt_logprobs: int | None = None
    #: OpenAI's additive penalties, over the output's tokens (resumed ones included, the prompt
    #: not): each logit loses ``presence_penalty`` if its token appeared, and ``frequency_penalty``
    #: per appearance. 0 = off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: (token id, bias) pairs added to the logits at every step, sorted by id; empty = none.
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: No end-of-sequence token is drawn and no stop string ends the answer before this many
    #: output tokens (resumed ones included); 0 = off.
    min_tokens: int = 0
    #: Tokens that end the answer as end-of-sequence does (their own text is not part of it), also
    #: with ``ignore_eos``.
    stop_token_ids: tuple[int, ...] = ()
    #: After temperature, tokens less likely than ``min_p`` × the likeliest one are dropped; 0 = off.
    min_p: float = 0.0
    #: The stop string, or stop token's text, that ended the answer stays in its text.
    include_stop_str_in_output: bool = False
    #: Only these tokens may be drawn; empty = any.
    allowed_token_ids: tuple[int, ...] = ()
    #: Words the answer must not write (vLLM's ``bad_words``).
    bad_words: tuple[str, ...] = ()
    #: ``bad_words`` as token sequences, filled by the engine at admission (its tokenizer's).
    bad_word_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidArgument("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgument(
                "min_tokens", f"must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}"
            )
        if math.isnan(self.temperature) or math.isinf(self.temperature) or self.temperature < 0:
            raise InvalidArgument("temperature", f"must be finite and >= 0, got {self.temperature}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:  # NaN fails too
            raise InvalidArgument("min_p", f"must be in [0, 1] (0 = off), got {self.min_p}")
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
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument("stop_token_ids", f"token ids must be >= 0, got {min(self.stop_token_ids)}")
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise InvalidArgument(
                "allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(self.allowed_token_ids)}"
            )
        if any(t < 0 for t in self.allowed_token_ids):
            raise InvalidArgument(
                "allowed_token_ids", f"token ids must be >= 0, got {min(self.allowed_token_ids)}"
            )
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidArgument("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        if any(not w.strip() or len(w) > MAX_STOP_CHARS for w in self.bad_words):
            raise InvalidArgument(
                "bad_words", f"each word must be 1 to {MAX_STOP_CHARS} characters, not blank"
            )
        if any(not s for s in self.stop):
            raise InvalidArgument("stop", "stop strings must not be empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidArgument("stop", f"a stop string may be at most {MAX_STOP_CHARS} characters")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(
                "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(
                "prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            # Slack for float32 as above; NaN fails the comparison.
            if not abs(value) <= MAX_ABS_ADDITIVE_PENALTY * (1 + 1e-6):
                raise InvalidArgument(
                    name,
                    f"must be in [-{MAX_ABS_ADDITIVE_PENALTY}, {MAX_ABS_ADDITIVE_PENALTY}] (0 = off), got {value}",
                )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument(
                "logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"
            )
        for token, bias in self.logit_bias:
            if token < 0:
                raise InvalidArgument("logit_bias", f"token ids must be >= 0, got {token}")
            if not abs(bias) <= MAX_ABS_LOGIT_BIAS * (1 + 1e-6):
                raise InvalidArgument(
                    "logit_bias",
                    f"values must be in [-{MAX_ABS_LOGIT_BIAS}, {MAX_ABS_LOGIT_BIAS}], got {bias} for token {token}",
                )

    @property
    def wants_logprobs(self) -> bool:
        """The engine computes log probabilities for this request's rows (and only then)."""
        return self.logprobs or self.top_logprobs > 0

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or below ``MIN_TEMPERATURE``) means argmax: no randomness, no seed needed."""
        return self.temperature < MIN_TEMPERATURE

    def held_back(self, num_output: int, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens not to be drawn after ``num_output`` output tokens: while fewer than
        ``min_tokens`` are out, the stop tokens and (unless ``ignore_eos``) the model's ``eos_ids``."""
        if num_output >= self.min_tokens:
            return ()
        return self.stop_token_ids if self.ignore_eos else self.stop_token_ids + eos_ids

    @functools.cached_property
    def adjusts_logits(self) -> bool:
        """Some setting moves the logits before the draw (a penalty or a bias): no argmax fast path."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or bool(self.allowed_token_ids)
            or bool(self.bad_word_ids)
        )
