"""State of one request inside the engine: its tokens, progress, KV blocks and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.inference.sampling import SamplingParams

if TYPE_CHECKING:
    from services.inference.outputs import SampledToken


class SequenceStatus(enum.IntEnum):
    """One ordered status: every finished state comes after the live ones."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


class FinishReason(enum.StrEnum):
    """Why a generation ended, as clients see it."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


FINISH_REASONS: dict[SequenceStatus, FinishReason] = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.CANCELLED,
    SequenceStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass
class Sequence:
    """A request's token stream. ``token_ids`` = prompt + resumed + generated tokens.

    Resumed tokens are treated as prompt for compute (their KV must be built) but
    count as output for numbering and ``max_tokens``.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    num_resumed_tokens: int = 0
    # The seed every draw of this request is keyed on (drawn at random when the
    # client gave none), so preemption-and-recompute reproduces the same tokens.
    seed: int = 0
    #: Cached prompt blocks are shared only among sequences with the same salt (kv_blocks.py).
    cache_salt: str = ""
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    error: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    prefill_done_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    #: With ``params.prompt_logprobs``: entry i is prompt token i's log probability (under the
    #: logits of position i - 1), set when that position is computed (again, after a preemption);
    #: entry 0's is NaN. Handed out with the first token, then dropped.
    prompt_logprobs: list[SampledToken | None] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Completion tokens so far, resumed ones included (they count against max_tokens)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_generated_tokens(self) -> int:
        """Tokens this engine generated (resumed ones excluded)."""
        return len(self.token_ids) - self.num_prompt_tokens - self.num_resumed_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)
