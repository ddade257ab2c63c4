"""What a chunk's vector is made from: its title and heading path, then its text, within the model's input.

The embedding model reads at most ``max_tokens`` tokens and silently drops the rest
(all-MiniLM-L6-v2: 256). A chunk is at most ``--chunk-tokens`` (200) long, so a title or
heading path of more than the ~54 tokens left pushed the chunk's own last words out of its
vector: three 158-token chunks under a 114-token title, which differ only in their last
sentence, all scored 0.15 against a question about one of those sentences (0.40 / 0.01 /
0.10 on their text alone). The context is the part to cut: it is there to say whose
text this is, and BM25 still indexes it whole (``corpus.search_text``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from services.retriever.schema import contextual_text

__all__ = ["InputBudget", "TokenCounting", "fitted_text"]

TokenSpans = Callable[[str], list[tuple[int, int]]]
# A tokenizer that merges across the line breaks between the parts can count a token or two
# more than the parts did apart: the fit is checked on the joined text and tightened this often.
_REFITS = 4


@runtime_checkable
class TokenCounting(Protocol):
    """An embedder that says how much it reads (``embedder.Embedder``)."""

    max_tokens: int
    special_tokens: int

    def token_spans(self, text: str) -> list[tuple[int, int]]: ...


@dataclass(frozen=True)
class InputBudget:
    """The embedding model's input length and how it counts tokens."""

    token_spans: TokenSpans
    #: Tokens the model reads, its special ones ([CLS], [SEP]) included.
    max_tokens: int
    special_tokens: int = 0

    @classmethod
    def of(cls, embedder: object) -> InputBudget | None:
        """The embedder's budget, or None for one that does not count tokens (test fakes)."""
        if not isinstance(embedder, TokenCounting):
            return None
        return cls(embedder.token_spans, embedder.max_tokens, embedder.special_tokens)

    def count(self, text: str) -> int:
        return len(self.token_spans(text)) + self.special_tokens


def fitted_text(
    title: str, heading_path: tuple[str, ...] | list[str], text: str, budget: InputBudget | None
) -> str:
    """``contextual_text(title, heading_path, text)``, with the title and path cut so the text fits whole.

    When both need cutting, the title keeps its start (whose document) and the path its end
    (the nearest heading), each at least half of the room; a part that needs less leaves the
    rest to the other. A text that alone fills the input is embedded alone.
    """
    whole = contextual_text(title, heading_path, text)
    if budget is None:
        return whole
    over = budget.count(whole) - budget.max_tokens
    if over <= 0:
        return whole
    path = " > ".join(h for h in heading_path if h)
    title_spans, path_spans = budget.token_spans(title), budget.token_spans(path)
    room = len(title_spans) + len(path_spans) - over
    for _ in range(_REFITS):
        if room <= 0:
            return text
        keep_title = min(len(title_spans), max(room - len(path_spans), room // 2))
        keep_path = min(len(path_spans), room - keep_title)
        fitted = contextual_text(
            title[: title_spans[keep_title - 1][1]] if keep_title else "",
            (path[path_spans[len(path_spans) - keep_path][0] :],) if keep_path else (),
            text,
        )
        over = budget.count(fitted) - budget.max_tokens
        if over <= 0:
            return fitted
        room -= over
    return text
