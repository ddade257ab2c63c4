"""History windowing: the newest turns that fit a prompt's token budget, system prompt first."""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.session.model import TurnRecord

# Without a tokenizer (the session service has none) ~4 UTF-8 bytes per token is the usual
# estimate for English BPE vocabularies; rounding up keeps a window from overrunning its budget.
BYTES_PER_TOKEN = 4


def estimate_tokens(text: str) -> int:
    """Tokens in ``text``, estimated as UTF-8 bytes / 4, rounded up."""
    return math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN)


def turn_tokens(turn: TurnRecord) -> int:
    """The caller's token count when it gave one, else the estimate."""
    return turn.token_count if turn.token_count is not None else estimate_tokens(turn.content)


def select_window(
    system_prompt: str, turns: Sequence[TurnRecord], token_budget: int = 0, max_turns: int = 0
) -> tuple[tuple[TurnRecord, ...], int]:
    """The newest turns that fit, oldest first, and how many older turns were left out.

    The system prompt is counted first and always kept (even when it alone exceeds the
    budget); the window is a contiguous suffix, so the model never sees a conversation
    with a hole in it. A budget or max of 0 means "no limit".
    """
    candidates = list(turns[-max_turns:]) if max_turns > 0 else list(turns)
    if token_budget > 0:
        remaining = token_budget - estimate_tokens(system_prompt)
        kept = 0
        for turn in reversed(candidates):
            cost = turn_tokens(turn)
            if cost > remaining:
                break
            remaining -= cost
            kept += 1
        candidates = candidates[len(candidates) - kept :]
    return tuple(candidates), len(turns) - len(candidates)
