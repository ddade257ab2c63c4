"""What the retriever stores and reads back: document records, chunks, search hits, cache entries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.retriever.embedder import Vectors


@dataclass(frozen=True)
class DocumentRecord:
    """A document's current state; its ``version`` names the chunks readers may see.

    A deleted document keeps its row as a tombstone with the version negated, so
    a later re-ingest continues the numbering: a cache entry that cited version 1
    of the deleted document must not come back to life when a new version 1 appears.
    """

    tenant: str
    document_id: str
    title: str
    mime_type: str
    source: str
    metadata: dict[str, str]
    content_hash: str
    version: int
    chunks: int
    updated_at_ms: int

    @property
    def deleted(self) -> bool:
        return self.version < 0

    @property
    def last_version(self) -> int:
        """The newest version number ever used, deleted or not."""
        return abs(self.version)


@dataclass(frozen=True)
class ChunkRow:
    """One chunk as written."""

    position: int
    text: str
    heading: str
    page: int
    #: What is embedded and keyword-indexed: title, heading path and text (``schema.contextual_text``).
    search_text: str = ""


@dataclass(frozen=True)
class ChunkHit:
    """One search candidate."""

    chunk_id: str
    document_id: str
    document_key: str
    title: str
    text: str
    score: float
    position: int
    page: int
    heading: str
    metadata: dict[str, str]
    document_version: int
    vector: Vectors | None = field(default=None, compare=False)
    #: What the search mode ordered by: cosine (dense), BM25 (keyword) or the rank fusion (hybrid).
    retrieval_score: float = 0.0
    #: The relevance reranker's score, when it ordered the results.
    rerank_score: float | None = None


@dataclass(frozen=True)
class AnswerUsage:
    """What a cached answer cost when it was made, kept so that every hit reports the same."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    #: common.proto's FinishReason number; 0 (UNSPECIFIED) when the writer did not say.
    finish_reason: int = 0


@dataclass(frozen=True)
class CacheRow:
    """One semantic-cache entry found near a prompt."""

    entry_id: str
    prompt: str
    answer: str
    similarity: float
    created_at_ms: int
    expires_at_ms: int
    cited: tuple[tuple[str, int], ...]
    usage: AnswerUsage = AnswerUsage()


def document_from_row(tenant: str, row: Mapping[str, Any]) -> DocumentRecord:
    """A row of the documents collection as the tenant's record."""
    return DocumentRecord(
        tenant=tenant,
        document_id=row["document_id"],
        title=row["title"],
        mime_type=row["mime_type"],
        source=row["source"],
        metadata={str(k): str(v) for k, v in (row.get("metadata") or {}).items()},
        content_hash=row["content_hash"],
        version=int(row["version"]),
        chunks=int(row["chunks"]),
        updated_at_ms=int(row["updated_at_ms"]),
    )
