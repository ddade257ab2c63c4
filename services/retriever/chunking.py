"""Splits sections into overlapping token windows sized for the embedding model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.retriever.parsing import Section

# Character spans of a text's tokens, in order (the embedding model's tokenizer provides them).
TokenSpans = Callable[[str], list[tuple[int, int]]]


@dataclass(frozen=True)
class Chunk:
    """One window of a document: what gets embedded and returned by search."""

    text: str
    position: int
    heading: str = ""
    page: int = 0


@dataclass(frozen=True)
class ChunkingPolicy:
    """Window size and overlap, in tokens of the embedding model."""

    max_tokens: int = 200
    overlap_tokens: int = 40

    def __post_init__(self) -> None:
        if self.max_tokens < 8:
            raise ValueError(f"chunk max_tokens must be >= 8, got {self.max_tokens}")
        if not 0 <= self.overlap_tokens < self.max_tokens // 2 + 1:
            raise ValueError(f"chunk overlap_tokens must be in [0, max_tokens/2], got {self.overlap_tokens}")


class TokenChunker:
    """Cuts each section into windows of at most ``max_tokens`` tokens, overlapping by ``overlap_tokens``.

    Windows never cross a section boundary, so every chunk keeps its heading and
    page. Chunk text is a slice of the original text (not detokenized), so case,
    punctuation and spacing survive.
    """

    def __init__(self, token_spans: TokenSpans, policy: ChunkingPolicy | None = None) -> None:
        self._token_spans = token_spans
        self._policy = policy or ChunkingPolicy()

    def chunk(self, sections: Iterable[Section]) -> list[Chunk]:
        chunks: list[Chunk] = []
        for section in sections:
            for text in self._windows(section.text):
                chunks.append(Chunk(text, len(chunks), section.heading, section.page))
        return chunks

    def _windows(self, text: str) -> list[str]:
        spans = self._token_spans(text)
        if not spans:
            return [text.strip()] if text.strip() else []
        size, overlap = self._policy.max_tokens, self._policy.overlap_tokens
        windows: list[str] = []
        start = 0
        while True:
            end = min(start + size, len(spans))
            windows.append(text[spans[start][0] : spans[end - 1][1]].strip())
            if end == len(spans):
                return [w for w in windows if w]
            start = end - overlap
