"""A tenant's documents: ingest (parse → chunk → embed → versioned write), search, delete, list.

Atomic replace: new chunks are written under the next document version while
the document record still names the old one, then the record is flipped to the
new version (one upsert of one row), then the old version's chunks are deleted.
Search keeps only chunks whose version is the one their document record names
at read time, so a reader sees the old chunks or the new ones, never a mix, and
a crash at any step leaves either version whole (the leftovers are invisible
and are cleaned up by the next ingest of that document).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.common.errors import InvalidArgument, NotFound
from services.retriever.chunking import Chunk, TokenChunker
from services.retriever.document_locks import DocumentLocks, LocalLocks
from services.retriever.embedder import Vectors
from services.retriever.embedding_input import InputBudget, fitted_text
from services.retriever.parsing import (
    DEFAULT_MAX_PARSE_SECONDS,
    DOCX,
    PDF,
    base_type,
    normalize_mime_type,
    parse_document,
)
from services.retriever.records import ChunkHit, ChunkRow, DocumentRecord
from services.retriever.rerank import Reranker
from services.retriever.schema import MAX_LABEL_BYTES, MAX_TEXT_BYTES, contextual_text, fit_bytes
from services.retriever.search import Searcher, SearchQuery, SearchResult, check_metadata
from services.retriever.store import MilvusStore
from services.retriever.terms import keyword_text
from services.retriever.text_encoding import declared_charset

__all__ = ["Corpus", "DocumentUpload", "IngestResult", "SearchQuery", "SearchResult"]

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
MAX_DOCUMENT_ID_CHARS = 256
# In UTF-8 bytes, the stored field's size: counted in characters, a non-ASCII title was accepted,
# then cut by the store, and never compared equal again ("unchanged" was never answered).
MAX_TITLE_BYTES = MAX_LABEL_BYTES


class TextEmbedder(Protocol):
    """What the corpus needs from the embedding model."""

    model_name: str
    dimension: int

    def embed(self, texts: Sequence[str]) -> Vectors: ...


@dataclass(frozen=True)
class DocumentUpload:
    """A complete document as received from a client."""

    document_id: str
    data: bytes
    mime_type: str = ""
    title: str = ""
    source: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class IngestResult:
    document_id: str
    chunks: int
    unchanged: bool
    content_hash: str
    version: int
    bytes: int


def check_document_id(document_id: str, field_name: str = "document_id") -> None:
    if not 1 <= len(document_id) <= MAX_DOCUMENT_ID_CHARS:
        raise InvalidArgument(field_name, f"must be 1-{MAX_DOCUMENT_ID_CHARS} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in document_id):
        raise InvalidArgument(field_name, "must not contain control characters")


def embedding_text(title: str, chunk: Chunk, budget: InputBudget | None = None) -> str:
    """What gets embedded: the chunk under its title and heading path, cut to the model's input
    from the context's side (``embedding_input``) so none of the chunk's own words are dropped."""
    return fitted_text(title, chunk.heading_path or (chunk.heading,), chunk.text, budget)


def search_text(title: str, chunk: Chunk) -> str:
    """What BM25 indexes (``keyword_text`` of the contextual text), within the field's bytes.

    The chunk's own text is kept first and the title and heading path get the room left: cut
    as a whole, long headings pushed the text out and a search for its words found nothing.
    """
    text = fit_bytes(keyword_text(chunk.text), MAX_TEXT_BYTES)
    room = MAX_TEXT_BYTES - len(text.encode()) - 1  # the line break between them
    context = keyword_text(contextual_text(title, chunk.heading_path or (chunk.heading,), ""))
    context = fit_bytes(context, room) if room > 0 else ""
    return f"{context}\n{text}" if context else text


def encode_page_token(last_document_id: str) -> str:
    return base64.urlsafe_b64encode(last_document_id.encode()).decode()


def decode_page_token(token: str) -> str:
    if not token:
        return ""
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise InvalidArgument("page_token", "not a token from a previous ListDocuments response") from exc


class Corpus:
    """Documents, chunks and search over one store. Blocking: call from worker threads."""

    def __init__(
        self,
        store: MilvusStore,
        embedder: TextEmbedder,
        chunker: TokenChunker,
        clock: Callable[[], float] = time.time,
        locks: DocumentLocks | None = None,
        reranker: Reranker | None = None,
        reranker_unavailable: str = "",
        max_parse_seconds: float = DEFAULT_MAX_PARSE_SECONDS,
    ) -> None:
        self._store = store
        self._max_parse_seconds = max_parse_seconds
        self._searcher = Searcher(store, embedder, reranker, reranker_unavailable)
        self._embedder = embedder
        self._input_budget = InputBudget.of(embedder)
        self._chunker = chunker
        self._clock = clock
        # One writer per document: in this process, or (Redis leases) across replicas.
        self._locks: DocumentLocks = locks if locks is not None else LocalLocks()

    def ingest(self, tenant: str, upload: DocumentUpload) -> IngestResult:
        """Stores the document unless identical content is already stored."""
        self._store.require_model()
        check_document_id(upload.document_id, "header.document_id")
        check_metadata(upload.metadata, "header.metadata")
        if len(upload.title.encode()) > MAX_TITLE_BYTES:
            raise InvalidArgument("header.title", f"must be at most {MAX_TITLE_BYTES} bytes (UTF-8)")
        mime_type = normalize_mime_type(upload.mime_type, upload.source)
        # The text formats' declared encoding (PDF and DOCX say their own), stored with the type:
        # the same bytes sent again declaring another charset are a new version, not "unchanged".
        # JSON, JSON Lines and application/csv are text too: their charset was dropped once.
        charset = None if mime_type in (PDF, DOCX) else declared_charset(upload.mime_type)
        if charset:
            mime_type += f"; charset={charset}"
        content_hash = hashlib.sha256(upload.data).hexdigest()
        # A title derived from `source` (up to its 4 KiB) is cut to the stored size, so that the
        # comparison below sees what the store keeps.
        title = fit_bytes(
            upload.title or (upload.source.rsplit("/", 1)[-1] if upload.source else "") or upload.document_id,
            MAX_TITLE_BYTES,
        )
        metadata = dict(upload.metadata)

        with self._locks.hold(tenant, upload.document_id) as lease:
            current = self._store.get_document(tenant, upload.document_id)
            if (
                current is not None
                and not current.deleted
                and current.content_hash == content_hash
                and (current.title, current.mime_type, current.metadata) == (title, mime_type, metadata)
            ):
                return IngestResult(
                    upload.document_id, current.chunks, True, content_hash, current.version, len(upload.data)
                )

            # Everything that can reject the input happens before the first write.
            chunks = self._chunker.chunk(
                parse_document(upload.data, base_type(mime_type), charset, self._max_parse_seconds)
            )
            if not chunks:
                raise InvalidArgument("data", "document has no text to index")
            contexts = [embedding_text(title, c, self._input_budget) for c in chunks]
            vectors = self._embedder.embed(contexts)

            version = current.last_version + 1 if current is not None else 1
            record = DocumentRecord(
                tenant=tenant,
                document_id=upload.document_id,
                title=title,
                mime_type=mime_type,
                source=upload.source,
                metadata=metadata,
                content_hash=content_hash,
                version=version,
                chunks=len(chunks),
                updated_at_ms=int(self._clock() * 1000),
            )
            # Leftovers of an interrupted earlier ingest (never made current) must not share our version.
            self._store.delete_chunks(
                tenant,
                upload.document_id,
                keep_version=current.version if current and not current.deleted else None,
            )
            rows = [ChunkRow(c.position, c.text, c.heading, c.page, search_text(title, c)) for c in chunks]
            self._store.write_chunks(record, rows, vectors)
            lease.check()  # another replica may write this document once our lease is gone
            self._store.put_document(record)  # the flip: readers now see version `version`
            self._store.delete_chunks(tenant, upload.document_id, keep_version=version)
        return IngestResult(upload.document_id, len(chunks), False, content_hash, version, len(upload.data))

    def find(self, tenant: str, query: SearchQuery) -> SearchResult:
        """The search's hits and how it ran (mode, reranked, degraded)."""
        return self._searcher.search(tenant, query)

    def search(self, tenant: str, query: SearchQuery) -> list[ChunkHit]:
        return self.find(tenant, query).hits

    def delete(self, tenant: str, document_id: str) -> int:
        check_document_id(document_id)
        with self._locks.hold(tenant, document_id) as lease:
            record = self._store.get_document(tenant, document_id)
            if record is None or record.deleted:
                raise NotFound(f"document {document_id!r} not found")
            lease.check()
            # Tombstone first: from this instant no search returns the document's chunks.
            self._store.put_tombstone(record)
            return self._store.delete_chunks(tenant, document_id)

    def list(self, tenant: str, page_size: int, page_token: str) -> tuple[list[DocumentRecord], str]:
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise InvalidArgument("page_size", f"must be in 1..{MAX_PAGE_SIZE} (0 = {DEFAULT_PAGE_SIZE})")
        size = page_size or DEFAULT_PAGE_SIZE
        after = decode_page_token(page_token)
        records = self._store.list_documents(tenant, after, size + 1)
        next_token = encode_page_token(records[size - 1].document_id) if len(records) > size else ""
        return records[:size], next_token
