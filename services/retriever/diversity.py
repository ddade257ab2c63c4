"""Maximal marginal relevance: reorders search candidates to trade a little relevance for diversity."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def maximal_marginal_relevance(
    query: npt.NDArray[np.float32],
    candidates: npt.NDArray[np.float32],
    k: int,
    relevance_weight: float = 0.7,
    relevance: npt.NDArray[np.float32] | None = None,
) -> list[int]:
    """Indices of ``k`` candidates picked greedily by ``w·sim(query) − (1−w)·max sim(already picked)``.

    Vectors must be unit length. Near-duplicate chunks (overlapping windows, the
    same paragraph in two documents) stop crowding out everything else.
    ``relevance`` replaces ``sim(query)`` when a better judge (the reranker) scored them.
    """
    if not 0.0 <= relevance_weight <= 1.0:
        raise ValueError(f"relevance_weight must be in [0, 1], got {relevance_weight}")
    count = len(candidates)
    if count == 0 or k <= 0:
        return []
    relevance = candidates @ query if relevance is None else np.asarray(relevance, dtype=np.float32)
    pairwise = candidates @ candidates.T
    picked: list[int] = [int(np.argmax(relevance))]
    redundancy = pairwise[picked[0]].copy()
    available = np.ones(count, dtype=bool)
    available[picked[0]] = False
    while len(picked) < min(k, count):
        scores = relevance_weight * relevance - (1.0 - relevance_weight) * redundancy
        scores[~available] = -np.inf
        best = int(np.argmax(scores))
        picked.append(best)
        available[best] = False
        redundancy = np.maximum(redundancy, pairwise[best])
    return picked
