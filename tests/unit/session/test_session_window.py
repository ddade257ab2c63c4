"""History windowing: newest turns within a token budget, the system prompt always first."""

from __future__ import annotations

from services.session.model import TurnRecord
from services.session.window import estimate_tokens, select_window


def turns(*counts: int | None) -> list[TurnRecord]:
    return [TurnRecord("user", f"turn-{i:03d}", token_count=c) for i, c in enumerate(counts)]


def test_estimate_is_utf8_bytes_over_four_rounded_up() -> None:
    assert [estimate_tokens(t) for t in ("", "a", "abcd", "abcde", "é" * 3)] == [0, 1, 1, 2, 2]


def test_keeps_the_newest_contiguous_turns_that_fit_after_the_system_prompt() -> None:
    history = turns(5, 50, 5, 5)
    kept, omitted = select_window("s" * 8, history, token_budget=2 + 5 + 5 + 10)  # system prompt = 2 tokens
    assert kept == tuple(history[2:]) and omitted == 2  # the 50-token turn stops the window: no holes


def test_a_system_prompt_over_budget_leaves_no_turns() -> None:
    kept, omitted = select_window("s" * 400, turns(1, 1), token_budget=10)
    assert kept == () and omitted == 2


def test_turns_without_a_count_are_estimated() -> None:
    history = [TurnRecord("user", "x" * 40), TurnRecord("assistant", "y" * 8)]  # 10 and 2 tokens
    assert select_window("", history, token_budget=11)[0] == (history[1],)
    assert select_window("", history, token_budget=12)[0] == tuple(history)


def test_max_turns_and_no_limits() -> None:
    history = turns(1, 1, 1, 1)
    assert select_window("", history, max_turns=3) == (tuple(history[1:]), 1)
    assert select_window("", history) == (tuple(history), 0)
    assert select_window("", history, token_budget=100, max_turns=10) == (tuple(history), 0)
