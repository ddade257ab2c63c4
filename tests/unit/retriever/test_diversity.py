"""Maximal marginal relevance: near-duplicates stop crowding out other relevant chunks."""

from __future__ import annotations

import numpy as np

from services.retriever.diversity import maximal_marginal_relevance
from services.retriever.embedder import normalize_rows


def test_mmr_prefers_a_different_relevant_chunk_over_a_near_duplicate() -> None:
    query = normalize_rows(np.array([[1.0, 0.0, 0.0]]))[0]
    candidates = normalize_rows(
        np.array(
            [
                [0.95, 0.30, 0.0],  # most relevant
                [0.94, 0.31, 0.0],  # near-duplicate of the first
                [0.80, 0.0, 0.60],  # a little less relevant, about something else
            ]
        )
    )
    assert maximal_marginal_relevance(query, candidates, k=2, relevance_weight=0.5) == [0, 2]
    # Pure relevance keeps the plain similarity order.
    assert maximal_marginal_relevance(query, candidates, k=3, relevance_weight=1.0) == [0, 1, 2]


def test_mmr_returns_at_most_the_candidates_it_has() -> None:
    query = np.array([1.0, 0.0], dtype=np.float32)
    assert maximal_marginal_relevance(query, np.zeros((0, 2), dtype=np.float32), k=3) == []
    assert maximal_marginal_relevance(query, np.eye(2, dtype=np.float32), k=5) == [0, 1]
