"""Prometheus metrics of the retriever: ingest and search latency, chunks written, cache outcomes,
and how many query texts each coalesced embedding call took."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from services.common.metrics import LATENCY_BUCKETS

INGEST_SECONDS = Histogram(
    "llmmesh_retriever_ingest_seconds",
    "Time to ingest one document (receive, parse, chunk, embed, write).",
    buckets=LATENCY_BUCKETS,
)
SEARCH_SECONDS = Histogram(
    "llmmesh_retriever_search_seconds",
    "Time to answer one Search (embed the query, search Milvus, filter, rerank).",
    buckets=LATENCY_BUCKETS,
)
CHUNKS = Counter(
    "llmmesh_retriever_chunks_total",
    "Chunks written to Milvus by ingests.",
)
CACHE_LOOKUPS = Counter(
    "llmmesh_semantic_cache_lookups_total",
    "Semantic-cache look-ups by result (hit or miss).",
    ["result"],
)
EMBED_CALL_TEXTS = Histogram(
    "llmmesh_retriever_embed_call_texts",
    "Query texts per model call of the embed coalescer (embed_batching.py): above 1 under concurrent load.",
    buckets=(1, 2, 4, 8, 16),
)
