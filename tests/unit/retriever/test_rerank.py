"""The context reranker: whose chunk it is decides between look-alikes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.retriever.embedder import Vectors
from services.retriever.records import ChunkHit
from services.retriever.rerank import DEFAULT_RERANK_MODEL, ContextReranker, load_reranker


class ConstantEmbedder:
    """Every text the same vector: only the title-word signal can tell candidates apart."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def embed(self, texts: Sequence[str]) -> Vectors:
        self.calls.append(list(texts))
        return np.ones((len(texts), 2), dtype=np.float32) / np.sqrt(2)


def hit(document_id: str, title: str, heading: str, score: float) -> ChunkHit:
    return ChunkHit(document_id, document_id, document_id, title, "text", score, 0, 0, heading, {}, 1)


def test_the_title_word_only_one_twin_has_outweighs_a_slightly_better_cosine() -> None:
    embedder = ConstantEmbedder()
    reranker = ContextReranker(embedder)
    candidates = [
        hit("kovari", "Kovari Coffee Cooperative", "Soil", 0.70),
        hit("velasi", "Velasi Coffee Cooperative", "Ground", 0.69),
    ]
    query = np.ones(2, dtype=np.float32) / np.sqrt(2)
    kovari, velasi = reranker.score("What soil do the Velasi coffee farms grow in?", query, candidates)
    assert velasi > kovari
    # "coffee" is in both titles, so it alone changes nothing.
    same = reranker.score("coffee soil", query, candidates)
    assert same[0] > same[1]
    # Labels are embedded once and then reused.
    assert sum(len(c) for c in embedder.calls) == 2


def test_no_reranker_by_default_and_the_context_one_needs_nothing_but_the_embedder() -> None:
    # (A directory that cannot be loaded is tested in integration: importing CrossEncoder takes seconds.)
    assert load_reranker(DEFAULT_RERANK_MODEL, ConstantEmbedder()) == (None, "")
    reranker, reason = load_reranker("context", ConstantEmbedder())
    assert isinstance(reranker, ContextReranker) and reason == ""
