"""Splits sections into chunks sized for the embedding model, along paragraph boundaries."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import pairwise

from services.retriever.parsing import Section

# Character spans of a text's tokens, in order (the embedding model's tokenizer provides them).
TokenSpans = Callable[[str], list[tuple[int, int]]]
# A blank line ends a paragraph; text without any (HTML and DOCX blocks) has one block per line.
_BLANK_LINE = re.compile(r"\n[ \t]*\n\s*")
_LINE_BREAK = re.compile(r"\n\s*")


#: Characters one token may count for when sizing chunks. The embedding model's WordPiece
#: tokenizer makes a "word" of over 100 characters one [UNK] token, so without this a base64
#: image in Markdown or a minified line would be a "one-token" paragraph of megabytes: one
#: chunk that search then hands whole to a prompt. Real tokens are shorter than this.
MAX_TOKEN_CHARS = 16


def bounded(token_spans: TokenSpans) -> TokenSpans:
    """``token_spans`` turned into spans that each account for at most ``MAX_TOKEN_CHARS``
    characters of the text, counting the gap before a token with it: a span ends at most that
    many characters after the previous one (or the text's start), and the text's tail is covered.

    The tokenizer gives no token for what it drops: runs of spaces, zero-width and combining
    characters, private-use ones. Uncounted, 70,000 spaces between two sentences made a
    "one-paragraph, 15-token" chunk of 70 KB, whose tail the store then cut off silently; and
    counting a 16-character token and the 16 characters before it as one let a chunk grow to
    twice ``max_tokens × MAX_TOKEN_CHARS``. Ordinary text (a space, then a token of at most
    15 characters) still counts one span per token."""

    def spans(text: str) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        at = 0  # how far the spans so far account for
        for start, end in [*token_spans(text), (len(text), len(text))]:
            if end <= at:
                continue
            if end - at <= MAX_TOKEN_CHARS:
                out.append((max(start, at) if start < end else at, end))
            else:  # the gap and the token in pieces of at most MAX_TOKEN_CHARS, cut from the
                # token's end back, so a window starting at a piece starts at a token if it can
                edges = sorted({at, *range(end, at, -MAX_TOKEN_CHARS)})
                out.extend(pairwise(edges))
            at = end
        return out

    return spans


@dataclass(frozen=True)
class Chunk:
    """One piece of a document: what gets embedded and returned by search."""

    text: str
    position: int
    heading: str = ""
    page: int = 0
    #: The headings above the chunk, outermost first (``heading`` last).
    heading_path: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChunkingPolicy:
    """Chunk size and, for a paragraph longer than one chunk, the overlap of its windows, in tokens."""

    max_tokens: int = 200
    overlap_tokens: int = 40

    def __post_init__(self) -> None:
        if self.max_tokens < 8:
            raise ValueError(f"chunk max_tokens must be >= 8, got {self.max_tokens}")
        if not 0 <= self.overlap_tokens < self.max_tokens // 2 + 1:
            raise ValueError(f"chunk overlap_tokens must be in [0, max_tokens/2], got {self.overlap_tokens}")


def paragraph_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of ``text``'s paragraphs (blank-line separated, else one per line)."""
    separator = _BLANK_LINE if _BLANK_LINE.search(text) else _LINE_BREAK
    spans, start = [], 0
    for match in separator.finditer(text):
        spans.append((start, match.start()))
        start = match.end()
    spans.append((start, len(text)))
    # Trailing spaces belong to the gap after a paragraph, which packing counts (_pieces).
    return [(a, a + len(text[a:b].rstrip())) for a, b in spans if text[a:b].strip()]


class TokenChunker:
    """Packs each section's whole paragraphs into chunks of at most ``max_tokens`` tokens.

    A chunk never crosses a section boundary, so it keeps its heading path and
    page, and never splits a paragraph that fits in one chunk: a chunk is about
    what its paragraphs are about. A paragraph longer than a chunk is cut into
    windows overlapping by ``overlap_tokens``; a token and the gap before it count once per
    ``MAX_TOKEN_CHARS`` characters, and so does the gap between two paragraphs packed
    together, so no chunk is longer than ``max_tokens × MAX_TOKEN_CHARS``. Chunk text is a slice of the
    original text (not detokenized), so case, punctuation and spacing survive.
    """

    def __init__(self, token_spans: TokenSpans, policy: ChunkingPolicy | None = None) -> None:
        self._token_spans = bounded(token_spans)
        self._policy = policy or ChunkingPolicy()

    def chunk(self, sections: Iterable[Section]) -> list[Chunk]:
        chunks: list[Chunk] = []
        for section in sections:
            path = section.path or ((section.heading,) if section.heading else ())
            for text in self._pieces(section.text):
                chunks.append(Chunk(text, len(chunks), section.heading, section.page, path))
        return chunks

    def _pieces(self, text: str) -> list[str]:
        pieces: list[str] = []
        # The paragraphs packed so far: (start, end) of the run and its token count.
        run: tuple[int, int] | None = None
        run_tokens = 0
        for start, end in paragraph_spans(text):
            tokens = len(self._token_spans(text[start:end]))
            if run is not None:
                # Joined, the gap before the paragraph is in the chunk too: 70,000 spaces after
                # a blank line were, uncounted. A short gap costs nothing extra.
                joined = len(self._token_spans(text[run[1] : end]))
                if run_tokens + joined <= self._policy.max_tokens:
                    run, run_tokens = (run[0], end), run_tokens + joined
                    continue
            if run is not None:
                pieces.append(text[run[0] : run[1]].strip())
            if tokens <= self._policy.max_tokens:
                run, run_tokens = (start, end), tokens
            else:
                pieces.extend(self._windows(text[start:end]))
                run, run_tokens = None, 0
        if run is not None:
            pieces.append(text[run[0] : run[1]].strip())
        return [p for p in pieces if p]

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
