"""One search: candidates from Milvus in the asked mode, stale versions dropped, then rerank and diversity.

The order of the steps matters: the version filter first (a reader never sees
a half-replaced document), then ``min_score`` (a cosine bound, the same in
every mode), then the relevance reranker over the best ``rerank_candidates``,
then maximal marginal relevance when asked (it trades relevance for
diversity, so it comes last). The first two filter before anything is cut to
``top_k``: in keyword and hybrid modes the order is not by cosine, so a chunk
that passes ``min_score`` may sit below ``top_k`` that do not.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from services.common.errors import InvalidArgument
from services.retriever.diversity import maximal_marginal_relevance
from services.retriever.embedder import Vectors
from services.retriever.filters import METADATA_KEY_RE
from services.retriever.records import ChunkHit
from services.retriever.rerank import DEFAULT_CANDIDATES, MAX_CANDIDATES, Reranker
from services.retriever.search_modes import DEFAULT_MODE, SearchMode
from services.retriever.store import MAX_QUERY_WINDOW, MilvusStore
from services.retriever.terms import keyword_query

log = logging.getLogger("llmmesh.retriever.search")

DEFAULT_TOP_K = 5
MAX_TOP_K = 100
MAX_QUERY_CHARS = 8192
MAX_METADATA_ENTRIES = 64
MAX_METADATA_VALUE_CHARS = 1024
# All keys and values together, UTF-8: 64 full-length values (64 KiB) on each of 100 search
# results or 1,000 listed documents made responses past gRPC's 4 MiB message limit.
MAX_METADATA_BYTES = 8192
# Candidates fetched per result: room for stale versions dropped and for MMR to choose from.
_OVERFETCH = 4
# What maximal marginal relevance chooses from: this many candidates per result, at least
# _MMR_MIN_POOL. Given only the top_k it could reorder them but never swap a near-duplicate out.
_MMR_POOL_FACTOR = 4
_MMR_MIN_POOL = 20
# How deep keyword mode looks for chunks that pass ``min_score``: its order says nothing of the
# cosine, so nothing else bounds the search, and a query with a high minimum read every match (up
# to Milvus's 16,384 rows, texts included) for each request.
_KEYWORD_MIN_SCORE_DEPTH = 1280
_MODE_NAMES = ", ".join(f"{m.value} ({m.name})" for m in SearchMode)


def check_metadata(metadata: Mapping[str, str], field_name: str) -> None:
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise InvalidArgument(field_name, f"at most {MAX_METADATA_ENTRIES} entries")
    for key, value in metadata.items():
        if not METADATA_KEY_RE.fullmatch(key):
            raise InvalidArgument(field_name, f"key {key!r} must be 1-64 of letters, digits, '_', '.', '-'")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidArgument(field_name, f"value of {key!r} is longer than {MAX_METADATA_VALUE_CHARS}")
    size = sum(len(key.encode()) + len(value.encode()) for key, value in metadata.items())
    if size > MAX_METADATA_BYTES:
        raise InvalidArgument(
            field_name, f"keys and values are {size} bytes (UTF-8) together; at most {MAX_METADATA_BYTES}"
        )


@dataclass(frozen=True)
class SearchQuery:
    """A validated search; None (unset) means the default for ``top_k``, ``mode``, ``rerank`` and its candidates."""

    text: str
    top_k: int | None = None
    min_score: float | None = None
    metadata_filter: Mapping[str, str] = field(default_factory=dict)
    #: Maximal marginal relevance over the results (diversity).
    diversify: bool = False
    #: A SearchMode number; 0 or None is the default (hybrid).
    mode: int | None = None
    rerank: bool | None = None
    rerank_candidates: int | None = None

    def __post_init__(self) -> None:
        if not self.text.strip():
            raise InvalidArgument("query", "must not be empty")
        if len(self.text) > MAX_QUERY_CHARS:
            raise InvalidArgument("query", f"must be at most {MAX_QUERY_CHARS} characters")
        if self.top_k is not None and not 1 <= self.top_k <= MAX_TOP_K:
            raise InvalidArgument(
                "top_k", f"must be in 1..{MAX_TOP_K} (unset = {DEFAULT_TOP_K}), got {self.top_k}"
            )
        if self.min_score is not None and not (
            math.isfinite(self.min_score) and -1.0 <= self.min_score <= 1.0
        ):
            raise InvalidArgument(
                "min_score", f"must be a cosine similarity in [-1, 1], got {self.min_score}"
            )
        if self.mode and self.mode not in {m.value for m in SearchMode}:
            raise InvalidArgument("mode", f"unknown search mode {self.mode}; known: {_MODE_NAMES}")
        if self.rerank_candidates is not None and not 1 <= self.rerank_candidates <= MAX_CANDIDATES:
            raise InvalidArgument(
                "rerank_candidates",
                f"must be in 1..{MAX_CANDIDATES} (unset = {DEFAULT_CANDIDATES}), got {self.rerank_candidates}",
            )
        check_metadata(self.metadata_filter, "metadata_filter")

    @property
    def limit(self) -> int:
        return DEFAULT_TOP_K if self.top_k is None else self.top_k

    @property
    def search_mode(self) -> SearchMode:
        return SearchMode(self.mode) if self.mode else DEFAULT_MODE

    @property
    def candidates(self) -> int:
        """How many the reranker scores: never fewer than the results asked for."""
        return max(self.limit, self.rerank_candidates or DEFAULT_CANDIDATES)


@dataclass(frozen=True)
class SearchResult:
    hits: list[ChunkHit]
    mode: SearchMode
    reranked: bool = False
    #: Why something asked for was not done; empty when the search ran as asked.
    degraded: str = ""


class QueryEmbedder(Protocol):
    def embed(self, texts: Sequence[str]) -> Vectors: ...


class Searcher:
    """Runs searches over one store. Blocking: call from worker threads."""

    def __init__(
        self,
        store: MilvusStore,
        embedder: QueryEmbedder,
        reranker: Reranker | None = None,
        reranker_unavailable: str = "",
    ) -> None:
        self._store = store
        self._embedder = embedder
        self._reranker = reranker
        # Why the configured reranker is missing (it failed to load), for the `degraded` note.
        self._reranker_unavailable = reranker_unavailable

    def search(self, tenant: str, query: SearchQuery) -> SearchResult:
        vector = self._embedder.embed([query.text])[0]
        mode = query.search_mode
        want_rerank = query.rerank if query.rerank is not None else self._reranker is not None
        pool = _mmr_pool(query.limit) if query.diversify else 0
        wanted = max(query.limit, query.candidates if want_rerank else 0, pool)
        # Already filtered by version and min_score, in the mode's order.
        visible = self._visible(tenant, query, mode, vector, wanted, with_vectors=query.diversify)
        reranked, degraded = False, ""
        if want_rerank:
            if self._reranker is None:
                degraded = self._reranker_unavailable or "no reranker is configured (--rerank-model none)"
            else:
                try:
                    visible = self._rerank(self._reranker, query, vector, visible)
                    reranked = True
                except Exception as exc:  # a reranker failure must not fail the search
                    log.warning("reranker %s failed: %s", self._reranker.name, exc)
                    degraded = f"the reranker failed ({type(exc).__name__}); results are not reranked"
        elif query.rerank is None and self._reranker_unavailable:
            degraded = self._reranker_unavailable
        if query.diversify and len(visible) > 1:
            # Reranked: MMR chooses among what the reranker scored, so every relevance is its own.
            choices = visible[: query.candidates] if reranked else visible
            visible = self._diversify(vector, choices, query.limit, mode, reranked)
        return SearchResult(visible[: query.limit], mode, reranked, degraded)

    def _visible(
        self,
        tenant: str,
        query: SearchQuery,
        mode: SearchMode,
        vector: Vectors,
        wanted: int,
        with_vectors: bool = False,
    ) -> list[ChunkHit]:
        """The best ``wanted`` chunks, in the mode's order, whose document still names their
        version and whose cosine is at least ``min_score``."""
        minimum = query.min_score
        fetch = min(MAX_QUERY_WINDOW, max(wanted * _OVERFETCH, 20))
        while True:
            # With a minimum, hybrid keeps its whole fusion (up to 2 × fetch): then every chunk
            # among the `fetch` nearest by cosine is a candidate, which bounds the search below.
            fused = 2 * fetch if mode is SearchMode.HYBRID and minimum is not None else None
            candidates = self._store.search_chunks(
                tenant,
                mode,
                keyword_query(query.text),
                vector,
                fetch,
                query.metadata_filter,
                with_vectors,
                fused_limit=fused,
            )
            current = self._store.current_versions(tenant, (h.document_key for h in candidates))
            # A chunk counts only if its document still names its version: no mixes during a replace.
            visible = [
                h
                for h in candidates
                if current.get(h.document_key) == h.document_version
                and (minimum is None or h.score >= minimum)
            ]
            # Short because stale or low-scoring chunks took places: look further down the list,
            # unless the store has no more or no chunk further down can reach the minimum.
            done = (
                len(visible) >= wanted
                or len(candidates) < fetch
                or fetch >= MAX_QUERY_WINDOW
                or (minimum is not None and _none_deeper_can_pass(mode, candidates, fetch, minimum))
            )
            if done:
                return visible[:wanted]
            fetch = min(MAX_QUERY_WINDOW, fetch * 4)

    @staticmethod
    def _diversify(
        vector: Vectors, hits: list[ChunkHit], limit: int, mode: SearchMode, reranked: bool
    ) -> list[ChunkHit]:
        matrix = np.stack([h.vector for h in hits if h.vector is not None])
        # Relevance is what ordered the hits, so MMR's first pick is the search's best chunk.
        relevance = None  # dense: the cosine, which ordered them
        if reranked:
            # The reranker's judgement, scaled to [0, 1] so the redundancy term keeps its weight.
            raw = np.asarray([h.rerank_score or 0.0 for h in hits], dtype=np.float32)
            relevance = (raw - raw.min()) / max(float(raw.max() - raw.min()), 1e-6)
        elif mode is not SearchMode.DENSE:
            # BM25 and RRF values have no fixed scale: the place in the mode's order, on the scale
            # of the full pool (not of what was found, which would make a short list's steps steep).
            places = max(len(hits), _mmr_pool(limit))
            relevance = 1.0 - np.arange(len(hits), dtype=np.float32) / places
        order = maximal_marginal_relevance(vector, matrix, limit, relevance=relevance)
        return [hits[i] for i in order]

    @staticmethod
    def _rerank(
        reranker: Reranker, query: SearchQuery, vector: Vectors, hits: list[ChunkHit]
    ) -> list[ChunkHit]:
        head, tail = hits[: query.candidates], hits[query.candidates :]
        scores = reranker.score(query.text, vector, head)
        scored = [replace(h, rerank_score=s) for h, s in zip(head, scores, strict=True)]
        # Stable: equal scores keep the search's order.
        return sorted(scored, key=lambda h: -(h.rerank_score or 0.0)) + tail


def _mmr_pool(limit: int) -> int:
    return max(limit * _MMR_POOL_FACTOR, _MMR_MIN_POOL)


def _none_deeper_can_pass(
    mode: SearchMode, candidates: Sequence[ChunkHit], fetch: int, minimum: float
) -> bool:
    """Whether no chunk past these ``fetch`` candidates can have a cosine of at least ``minimum``.

    Dense lists by cosine, so its last candidate bounds the rest. Hybrid (fused at 2 × fetch)
    holds the dense list's ``fetch`` nearest, so its fetch-th best cosine is that list's last.
    Keyword order says nothing of the cosine: it stops at ``_KEYWORD_MIN_SCORE_DEPTH`` matches.
    """
    if not candidates:
        return True
    if mode is SearchMode.DENSE:
        return candidates[-1].score < minimum
    if mode is SearchMode.HYBRID and len(candidates) >= fetch:
        return sorted((h.score for h in candidates), reverse=True)[fetch - 1] < minimum
    return mode is SearchMode.KEYWORD and fetch >= _KEYWORD_MIN_SCORE_DEPTH
