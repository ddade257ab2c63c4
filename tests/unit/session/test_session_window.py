"""History windowing: newest turns within a token budget, the system prompt always first."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.session.model import TurnRecord
from services.session.window import estimate_tokens, select_window


def turns(*counts: int | None) -> list[TurnRecord]:
    return [TurnRecord("user", f"turn-{i:03d}", token_count=c) for i, c in enumerate(counts)]


def test_estimate_is_ascii_bytes_over_three_and_three_quarters_of_a_token_for_every_other_byte() -> None:
    texts = ("", "a", "abc", "abcd", "é" * 3, "日本", "🤖")
    assert [estimate_tokens(t) for t in texts] == [0, 1, 1, 2, 5, 5, 3]


@pytest.mark.parametrize(
    ("language", "turn"),
    [
        ("English", ("Could you tell me more about the history of the lighthouse?", "It was built in 1887.")),
        ("short", ("ok", "Sure.")),
        ("Chinese", ("请告诉我更多关于这座灯塔的历史。", "它建于一八八七年，至今仍在使用。")),
        ("emoji", ("🤖🎨🌊🌅", "🎉✨🙂")),
        ("French", ("Pourriez-vous m'en dire plus sur l'histoire du phare ?", "Il a été construit en 1887.")),
        (
            "code",
            (
                "def f(x):\n    return [i * 2 for i in range(x) if i % 3 == 0]",
                '{"built": 1887, "tags": ["sea"]}',
            ),
        ),
    ],
)
def test_a_window_holds_about_its_budget_in_the_models_own_tokens(
    model_path: Path, language: str, turn: tuple[str, str]
) -> None:
    """Estimated as UTF-8 bytes / 4 with no template, a "2,048-token" window held 4,400 tokens of
    Chinese, 6,500 of emoji and 7,000 of short turns: with max_tokens past 2,000 the prompt no
    longer fit the model, on every later turn of the session. Now what it holds, as the chat
    template renders it for SmolLM2, is at most half again the budget in any of them (English is
    overcounted by a third, code and other Latin-script languages undercounted by up to 1.4x)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    history = [
        TurnRecord(role, text)
        for _ in range(400)
        for role, text in zip(("user", "assistant"), turn, strict=True)
    ]
    kept, _ = select_window("", history, token_budget=2048)
    rendered = tokenizer.apply_chat_template(
        [{"role": t.role, "content": t.content} for t in kept], tokenize=False
    )
    real = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert 2048 * 0.4 <= real <= 2048 * 1.5, (language, real, len(kept))


def test_keeps_the_newest_contiguous_turns_that_fit_after_the_system_prompt() -> None:
    history = turns(5, 50, 5, 5)
    # The system prompt is 2 tokens; each turn costs its count plus the template's 5.
    kept, omitted = select_window("s" * 8, history, token_budget=2 + 10 + 10 + 10)
    assert kept == tuple(history[2:]) and omitted == 2  # the 50-token turn stops the window: no holes


def test_a_system_prompt_over_budget_leaves_no_turns() -> None:
    kept, omitted = select_window("s" * 400, turns(1, 1), token_budget=10)
    assert kept == () and omitted == 2


def test_turns_without_a_count_are_estimated() -> None:
    history = [TurnRecord("user", "x" * 40), TurnRecord("assistant", "y" * 8)]  # 14 + 5 and 3 + 5 tokens
    assert select_window("", history, token_budget=26) == ((), 2)  # the answer alone is no exchange
    assert select_window("", history, token_budget=27)[0] == tuple(history)


def test_a_window_that_leaves_turns_out_starts_at_a_user_turn() -> None:
    """Cut mid-exchange, the window began with an answer whose question it no longer held, or a
    tool's result whose call it had dropped."""
    history = [
        TurnRecord("user", "What is in the report?", token_count=40),
        TurnRecord("assistant", "It is about x.", token_count=5),
        TurnRecord("user", "Weather?", token_count=5),
        TurnRecord("assistant", '{"name": "weather"}', token_count=5),
        TurnRecord("tool", "sunny", token_count=5),
        TurnRecord("assistant", "It is sunny.", token_count=5),
    ]
    assert select_window("", history, token_budget=50) == (tuple(history[2:]), 2)
    assert select_window("", history, token_budget=25) == ((), 6)  # tool, answer: no question
    assert select_window("", history, max_turns=5) == (tuple(history[2:]), 2)
    # Turns the caller cut off already count too; a whole history may begin with a greeting.
    assert select_window("", history[1:], preceded=True) == (tuple(history[2:]), 1)
    assert select_window("", history[1:]) == (tuple(history[1:]), 0)


def test_max_turns_and_no_limits() -> None:
    history = turns(1, 1, 1, 1)
    assert select_window("", history, max_turns=3) == (tuple(history[1:]), 1)
    assert select_window("", history) == (tuple(history), 0)
    assert select_window("", history, token_budget=100, max_turns=10) == (tuple(history), 0)
