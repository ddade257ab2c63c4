"""A chunk's vector reads all of its own words, however long its title and heading path are."""

from __future__ import annotations

import re

import numpy as np
import pytest

from services.retriever.chunking import Chunk
from services.retriever.corpus import embedding_text
from services.retriever.embedder import Embedder
from services.retriever.embedding_input import InputBudget, fitted_text
from services.retriever.schema import contextual_text


def word_spans(text: str) -> list[tuple[int, int]]:
    """One token a word: the fit's arithmetic is the subject, not the vocabulary."""
    return [m.span() for m in re.finditer(r"\S+", text)]


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


# 12 tokens in all, 2 of them special: 10 for title, path and text together.
BUDGET = InputBudget(word_spans, max_tokens=12, special_tokens=2)


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


def test_a_context_that_fits_is_kept_whole() -> None:
    assert fitted_text("Pump log", ["East", "Valves"], "w0 w1", BUDGET) == contextual_text(
        "Pump log", ["East", "Valves"], "w0 w1"
    )


def test_the_title_keeps_its_start_and_the_path_its_nearest_heading() -> None:
    fitted = fitted_text(words("t", 6), [words("a", 3), words("b", 3)], words("w", 6), BUDGET)
    title, path, text = fitted.split("\n")
    assert text == words("w", 6)  # every word of the chunk, first and last included
    assert title == "t0 t1" and path == "b1 b2"  # 4 tokens of room, half each
    assert len(word_spans(fitted)) + BUDGET.special_tokens == BUDGET.max_tokens


def test_a_short_part_leaves_its_room_to_the_other() -> None:
    title, path, _ = fitted_text(words("t", 9), ["Soil"], words("w", 4), BUDGET).split("\n")
    assert (title, path) == ("t0 t1 t2 t3 t4", "Soil")
    _, path, _ = fitted_text("Kovari", [words("h", 9)], words("w", 4), BUDGET).split("\n")
    assert path == "h4 h5 h6 h7 h8"


def test_a_chunk_that_fills_the_input_alone_is_embedded_alone() -> None:
    assert fitted_text("A title", ["A heading"], words("w", 10), BUDGET) == words("w", 10)


def test_the_real_model_tells_chunks_apart_by_their_last_words_under_a_long_title(
    embedder: Embedder,
) -> None:
    """Three chunks that differ only in their last sentence, under one long report title: cut
    to the model's 256 tokens, the title pushed those sentences out and all three had the
    same vector (0.15 each against a question about one of them)."""
    title = (
        "Quarterly operations report of the northern regional distribution centre covering "
        "staffing, logistics, procurement, facilities management, safety audits, vendor "
        "performance, customer service metrics and budget variance for the fiscal period. "
    ) * 3
    preamble = "This section summarises routine matters discussed at the meeting. " * 12
    endings = (
        "The forklift batteries will be replaced by solar powered units in June.",
        "The cafeteria will start serving vegetarian lunches every Friday.",
        "The loading dock roof leaks during heavy rain and needs sealing.",
    )
    budget = InputBudget.of(embedder)
    assert budget is not None and budget.max_tokens == embedder.max_tokens
    chunks = [Chunk(preamble + ending, i, "Minutes", 0, ("Minutes",)) for i, ending in enumerate(endings)]
    inputs = [embedding_text(title, c, budget) for c in chunks]
    for chunk, text in zip(chunks, inputs, strict=True):
        assert text.endswith(chunk.text) and text.startswith("Quarterly operations report")
        assert embedder.input_tokens(text) <= embedder.max_tokens
    vectors = embedder.embed(inputs)
    questions = (
        "When do the forklift batteries get replaced with solar units?",
        "Which day does the cafeteria serve vegetarian food?",
        "Where does the roof leak when it rains?",
    )
    scores = embedder.embed(list(questions)) @ vectors.T
    assert list(np.argmax(scores, axis=1)) == [0, 1, 2]
    # Each question's own chunk clearly ahead, not a tie broken by rounding.
    assert all(scores[i, i] - np.delete(scores[i], i).max() > 0.05 for i in range(3))
