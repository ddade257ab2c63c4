"""Chunking: token windows with overlap that never cross a section and keep heading and page."""

from __future__ import annotations

import random
import re

import pytest

from services.retriever.chunking import ChunkingPolicy, TokenChunker
from services.retriever.parsing import Section


def whitespace_token_spans(text: str) -> list[tuple[int, int]]:
    """Fake tokenizer (one token per word): the chunker's arithmetic is the subject here, not the vocabulary."""
    return [m.span() for m in re.finditer(r"\S+", text)]


def words(n: int, start: int = 0) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


def test_windows_overlap_and_cover_every_token() -> None:
    chunker = TokenChunker(whitespace_token_spans, ChunkingPolicy(max_tokens=10, overlap_tokens=3))
    chunks = chunker.chunk([Section(words(24), heading="H", page=2)])
    assert [c.text.split() for c in chunks] == [
        [f"w{i}" for i in range(0, 10)],
        [f"w{i}" for i in range(7, 17)],
        [f"w{i}" for i in range(14, 24)],
    ]
    assert {(c.heading, c.page) for c in chunks} == {("H", 2)}
    assert [c.position for c in chunks] == [0, 1, 2]


def test_chunks_never_cross_sections_and_keep_original_text() -> None:
    chunker = TokenChunker(whitespace_token_spans, ChunkingPolicy(max_tokens=8, overlap_tokens=2))
    sections = [
        Section("Short  Intro,  Kept As-Is.", heading="Intro"),
        Section(words(5), heading="Body", page=3),
    ]
    chunks = chunker.chunk(sections)
    assert [(c.text, c.heading, c.page, c.position) for c in chunks] == [
        ("Short  Intro,  Kept As-Is.", "Intro", 0, 0),
        (words(5), "Body", 3, 1),
    ]


@pytest.mark.parametrize(("max_tokens", "overlap"), [(4, 0), (100, 80), (100, -1)])
def test_policy_rejects_windows_that_cannot_make_progress(max_tokens: int, overlap: int) -> None:
    with pytest.raises(ValueError, match="chunk"):
        ChunkingPolicy(max_tokens=max_tokens, overlap_tokens=overlap)


def test_paragraphs_are_packed_whole_and_never_split_when_they_fit() -> None:
    chunker = TokenChunker(whitespace_token_spans, ChunkingPolicy(max_tokens=10, overlap_tokens=2))
    text = "\n\n".join([words(4, 0), words(5, 10), words(3, 20), words(8, 30)])
    chunks = chunker.chunk([Section(text, heading="H", path=("Doc", "H"))])
    # 4+5 fit in 10; 3 would overflow, so it starts the next chunk; 3+8 overflow again.
    assert [c.text.split() for c in chunks] == [
        words(4, 0).split() + words(5, 10).split(),
        words(3, 20).split(),
        words(8, 30).split(),
    ]
    assert {c.heading_path for c in chunks} == {("Doc", "H")}


def test_lines_are_paragraphs_when_a_text_has_no_blank_lines() -> None:
    chunker = TokenChunker(whitespace_token_spans, ChunkingPolicy(max_tokens=8, overlap_tokens=1))
    chunks = chunker.chunk([Section("\n".join([words(5, 0), words(5, 10)]))])
    assert [c.text for c in chunks] == [words(5, 0), words(5, 10)]


def test_a_giant_word_is_cut_so_no_chunk_grows_past_its_character_bound() -> None:
    from services.retriever.chunking import MAX_TOKEN_CHARS

    # A Markdown image inlined as base64: one "word" the embedding tokenizer makes one [UNK].
    blob = "data:image/png;base64," + "iVBORw0KGgo" * 3000
    text = f"Intro words here.\n\n![diagram]({blob})\n\nClosing words."

    def one_token_per_word(t: str) -> list[tuple[int, int]]:
        return [m.span() for m in re.finditer(r"\S+", t)]

    chunks = TokenChunker(one_token_per_word, ChunkingPolicy(max_tokens=50, overlap_tokens=5)).chunk(
        [Section(text)]
    )

    assert max(len(c.text) for c in chunks) <= 50 * MAX_TOKEN_CHARS
    assert chunks[0].text.startswith("Intro words here.") and chunks[-1].text.endswith("Closing words.")
    # Nothing lost: windows overlap by 5 × 16 characters, so every 64 characters sit whole in one.
    pieces = [blob[i : i + 64] for i in range(0, len(blob), 64)]
    assert all(any(piece in c.text for c in chunks) for piece in pieces)


@pytest.mark.parametrize(
    "gap", [" " * 70_000, "\u200b" * 30_000, "e\u0301" * 20_000], ids=["spaces", "zero-width", "combining"]
)
def test_text_the_tokenizer_drops_between_words_still_counts_towards_a_chunks_size(gap: str) -> None:
    """The embedding tokenizer gives no token for runs of spaces, zero-width or combining
    characters: uncounted, two sentences around 70,000 spaces were one 15-token chunk of 70 KB,
    whose tail the store cut off (a keyword search for "carry-over" then found nothing)."""
    from services.retriever.chunking import MAX_TOKEN_CHARS

    def drops_the_gap(t: str) -> list[tuple[int, int]]:
        return [m.span() for m in re.finditer(r"[A-Za-z0-9:.\-]+", t)]

    text = f"Vacation policy: staff get 25 days.{gap}Carry-over is capped at 5 days."
    chunks = TokenChunker(drops_the_gap, ChunkingPolicy(max_tokens=50, overlap_tokens=5)).chunk(
        [Section(text)]
    )

    assert max(len(c.text) for c in chunks) <= 50 * 2 * MAX_TOKEN_CHARS
    assert chunks[0].text.startswith("Vacation policy: staff get 25 days.")
    assert chunks[-1].text.endswith("Carry-over is capped at 5 days.")


def test_no_chunk_is_longer_than_its_tokens_times_the_character_bound() -> None:
    # The documented bound (--chunk-tokens × 16 characters) was broken twice: a 16-character
    # token and the 16 characters before it counted once (2×), and the whitespace after a
    # blank line between two packed paragraphs was not counted at all (70,000 spaces kept).
    from services.retriever.chunking import MAX_TOKEN_CHARS

    rng = random.Random(7)
    chunker = TokenChunker(whitespace_token_spans, ChunkingPolicy(max_tokens=20, overlap_tokens=4))
    for _ in range(40):
        parts = []
        for _ in range(rng.randint(1, 60)):
            word = "w" * rng.choice([1, 5, 15, 16, 17, 40])
            gap = rng.choice([" ", " " * 15, " " * 16, "\n\n", "\n\n" + " " * rng.randint(1, 500)])
            parts += [word, gap]
        text = "".join(parts)
        chunks = chunker.chunk([Section(text)])
        assert max(len(c.text) for c in chunks) <= 20 * MAX_TOKEN_CHARS
        # Nothing lost: every word is in some chunk.
        assert sum(len(w) for w in text.split()) <= sum(len(w) for c in chunks for w in c.text.split())
