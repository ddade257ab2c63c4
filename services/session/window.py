"""History windowing: the newest turns that fit a prompt's token budget, system prompt first."""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.session.model import TurnRecord

# Without a tokenizer (the session service has none): SmolLM2's took 3.9 bytes a token of
# English prose, 2.1-2.4 of French, German, Spanish, code and JSON (2026-12-07). 3 sits between:
# English is overcounted by a third, the others undercounted by up to 1.4x, so a window never
# holds much more than its budget in any of them. Rounding up keeps it from overrunning.
BYTES_PER_TOKEN = 3
#: Tokens per UTF-8 byte of text outside ASCII. Such vocabularies split it finely: with
#: SmolLM2's tokenizer Chinese took 1.6 tokens a character (3 bytes) and emoji 3.1 (4 bytes), so
#: bytes / 4 undercounted them 2-3x and a "2,048-token" window held 4,400-6,500 tokens.
NON_ASCII_TOKENS_PER_BYTE = 0.75
#: What the chat template adds around each turn (ChatML: "<|im_start|>", the role, a newline,
#: "<|im_end|>", a newline): a thousand short turns were 7,000 tokens, not the estimated 2,000.
TURN_OVERHEAD_TOKENS = 5


def estimate_tokens(text: str) -> int:
    """Tokens in ``text``: ASCII bytes / 3, plus 0.75 a byte of anything else, rounded up."""
    size = len(text.encode("utf-8"))
    ascii_size = len(text.encode("ascii", "ignore"))
    return math.ceil(ascii_size / BYTES_PER_TOKEN + (size - ascii_size) * NON_ASCII_TOKENS_PER_BYTE)


def turn_tokens(turn: TurnRecord) -> int:
    """The caller's token count when it gave one, else the estimate; with the template's share."""
    content = turn.token_count if turn.token_count is not None else estimate_tokens(turn.content)
    return content + TURN_OVERHEAD_TOKENS


def select_window(
    system_prompt: str,
    turns: Sequence[TurnRecord],
    token_budget: int = 0,
    max_turns: int = 0,
    preceded: bool = False,
) -> tuple[tuple[TurnRecord, ...], int]:
    """The newest turns that fit, oldest first, and how many older turns were left out.

    The system prompt is counted first and always kept (even when it alone exceeds the
    budget); the window is a contiguous suffix, so the model never sees a conversation
    with a hole in it. A budget or max of 0 means "no limit". ``preceded``: older turns than
    ``turns`` exist (the caller already cut them off).

    A window that leaves older turns out starts at a user turn: cut mid-exchange, it began
    with an answer to a question it no longer held, or a tool's result whose call it dropped.
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
    if preceded or len(candidates) < len(turns):
        start = next((i for i, t in enumerate(candidates) if t.role == "user"), len(candidates))
        candidates = candidates[start:]
    return tuple(candidates), len(turns) - len(candidates)
