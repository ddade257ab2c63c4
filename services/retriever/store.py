"""Milvus collections behind the retriever: chunks, document records and semantic-cache entries.

One code path for Milvus Lite (a local ``*.db`` path, served in-process) and a
Milvus server (``http://…``). Every read asks for Strong consistency, so a
search issued after an ingest returned sees that ingest's chunks. Filters only
ever embed hex digests and validated metadata keys; user strings that must
appear in a filter (metadata values) are JSON-quoted.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
from pymilvus import DataType, MilvusClient
from pymilvus.exceptions import MilvusException

from services.common.errors import DependencyUnavailable, FailedPrecondition, InvalidArgument
from services.retriever.embedder import Vectors

log = logging.getLogger("llmmesh.retriever.store")

T = TypeVar("T")

# Recorded on the vector collections so a server with another model refuses them.
MODEL_PROPERTY = "llmmesh.embedding_model"
DIMENSION_PROPERTY = "llmmesh.embedding_dimension"
CONSISTENCY = "Strong"
METADATA_KEY_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
# VARCHAR limits are bytes; text fields are cut to fit rather than rejected.
MAX_TEXT_BYTES = 65_535
MAX_LABEL_BYTES = 1_024
# Milvus answers at most this many rows per query or search.
MAX_QUERY_WINDOW = 16_384
_WRITE_BATCH = 256
# Milvus needs a vector field in every collection; the documents collection stores a constant one.
_PLACEHOLDER_DIM = 2
# Cache entries moved per round when an older cache collection is adopted (rows carry vectors).
_MIGRATION_BATCH = 512
# The usage columns of a cache entry: AnswerUsage's fields, one INT64 each.
_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "finish_reason")
# What the first cache schema stored (besides the vector): copied as they are when adopted.
_LEGACY_CACHE_FIELDS = (
    "entry_id",
    "tenant_key",
    "scope_key",
    "prompt",
    "answer",
    "created_at_ms",
    "expires_at_ms",
    "cited",
)
_UNREACHABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, 2}


def digest(*parts: str) -> str:
    """A fixed-length key for user-chosen strings (tenant, document id): safe in any filter."""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:40]


def fit_bytes(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes without splitting a character."""
    encoded = text.encode()
    if len(encoded) <= limit:
        return text
    return encoded[:limit].decode(errors="ignore")


#: What a Milvus filter string literal must escape. Every other character may stand as it is;
#: JSON's \u escapes (json.dumps writes them for control characters) are a parse error in Milvus.
_MILVUS_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r"})


def milvus_string(value: str) -> str:
    """``value`` as a double-quoted string literal in a Milvus filter expression."""
    return '"' + value.translate(_MILVUS_ESCAPES) + '"'


def metadata_condition(metadata_filter: Mapping[str, str]) -> str:
    """A Milvus filter requiring every key/value pair in a chunk's metadata."""
    terms = []
    for key, value in sorted(metadata_filter.items()):
        if not METADATA_KEY_RE.match(key):
            raise InvalidArgument(
                "metadata_filter", f"key {key!r} must be 1-64 of letters, digits, '_', '.', '-'"
            )
        terms.append(f'metadata["{key}"] == {milvus_string(value)}')
    return " and ".join(terms)


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


@dataclass(frozen=True)
class CollectionNames:
    chunks: str
    documents: str
    cache: str
    #: A cache collection of an older schema (no usage fields), moved into ``cache`` at startup.
    legacy_cache: str | None = None

    @classmethod
    def with_prefix(cls, prefix: str) -> CollectionNames:
        # Milvus Lite cannot add a field to an existing collection (AddCollectionField is not
        # implemented), so a new cache schema gets a new name and the old entries are moved over.
        return cls(
            f"{prefix}_chunks",
            f"{prefix}_documents",
            f"{prefix}_semantic_cache_v2",
            legacy_cache=f"{prefix}_semantic_cache",
        )


def is_lite_uri(uri: str) -> bool:
    return uri.endswith(".db")


def check_milvus_uri(uri: str) -> str:
    """The URI if usable: a ``*.db`` path (Milvus Lite) or an http(s)/tcp/unix URL."""
    if is_lite_uri(uri) or uri.startswith(("http://", "https://", "tcp://", "unix:")):
        return uri
    raise ValueError(
        f"--milvus-uri must be a path ending in .db (Milvus Lite) or http(s)://host:port, got {uri!r}"
    )


class MilvusStore:
    """Blocking access to the three collections; call it from worker threads."""

    def __init__(
        self,
        uri: str,
        model_name: str,
        dimension: int,
        names: CollectionNames | None = None,
        timeout_s: float = 10.0,
        search_ef: int = 64,
    ) -> None:
        check_milvus_uri(uri)
        if search_ef < 1:
            raise ValueError(f"--search-ef must be >= 1, got {search_ef}")
        # HNSW candidate list per search: larger finds more true neighbours, more slowly.
        self.search_ef = search_ef
        if is_lite_uri(uri):
            uri = str(Path(uri).expanduser())
            Path(uri).resolve().parent.mkdir(parents=True, exist_ok=True)
        self.uri = uri
        self.model_name = model_name
        self.dimension = dimension
        self.names = names or CollectionNames.with_prefix("llmmesh")
        self._timeout = timeout_s
        # Set when existing collections were built by another model: vector calls are refused.
        self.mismatch: str | None = None
        self._client = self._call(lambda: MilvusClient(uri=uri, timeout=timeout_s))
        try:
            self._call(self._ensure_collections)
        except BaseException:
            self.close()  # also stops Milvus Lite's threads, so the file is not left locked
            raise

    # -- lifecycle -------------------------------------------------------

    def close(self) -> None:
        try:
            self._client.close()
        finally:
            if is_lite_uri(self.uri):
                # Milvus Lite serves the file from threads in this process; stop them and release the lock.
                from milvus_lite.server_manager import server_manager_instance

                server_manager_instance.release_server(self.uri)

    def _ensure_collections(self) -> None:
        existing = set(self._client.list_collections(timeout=self._timeout))
        expected = {MODEL_PROPERTY: self.model_name, DIMENSION_PROPERTY: str(self.dimension)}
        for name, builder in (
            (self.names.chunks, self._chunk_schema),
            (self.names.documents, self._document_schema),
            (self.names.cache, self._cache_schema),
        ):
            if name not in existing:
                schema, index = builder()
                self._client.create_collection(
                    name,
                    schema=schema,
                    consistency_level=CONSISTENCY,
                    properties=expected,
                    timeout=self._timeout,
                )
                # sync=False: loading waits for the index anyway, and the index-progress poll
                # needs AllocTimestamp, which Milvus Lite lacks (it logs errors and sleeps).
                self._client.create_index(name, index, sync=False, timeout=self._timeout)
            else:
                found = self._client.describe_collection(name, timeout=self._timeout).get("properties", {})
                recorded = {k: str(found.get(k, "")) for k in expected}
                if recorded != expected and self.mismatch is None:
                    self.mismatch = (
                        f"collection {name} was built with embedding model {recorded[MODEL_PROPERTY]!r} "
                        f"(dimension {recorded[DIMENSION_PROPERTY]}), but this server runs "
                        f"{self.model_name!r} (dimension {self.dimension}); start it with the same "
                        "--embedding-model, or use another --collection-prefix or --milvus-uri"
                    )
            self._client.load_collection(name, timeout=self._timeout)
        legacy = self.names.legacy_cache
        if legacy is not None and legacy in existing:
            self._adopt_legacy_cache(legacy, expected)

    def _adopt_legacy_cache(self, legacy: str, expected: Mapping[str, str]) -> None:
        """Moves the entries of an older cache collection into the current one, then drops it.

        Its entries keep hitting, with usage 0 (it was never recorded). Rows are
        written to the new collection before they are deleted from the old one and
        the old one is dropped only when empty, so a crash midway loses nothing: the
        next start carries on (rewriting a row already moved is an idempotent upsert).
        """
        found = self._client.describe_collection(legacy, timeout=self._timeout).get("properties", {})
        if {k: str(found.get(k, "")) for k in expected} != dict(expected):
            # Its vectors come from another embedding model: useless here, and not ours to delete.
            log.warning("left %s in place: it was built with another embedding model", legacy)
            return
        moved = 0
        try:
            self._client.load_collection(legacy, timeout=self._timeout)
            while rows := self._query(legacy, 'entry_id != ""', ["*"], limit=_MIGRATION_BATCH):
                self._upsert(self.names.cache, [_legacy_cache_row(row) for row in rows])
                self._settle(self.names.cache)
                self.delete_cache_entries([str(row["entry_id"]) for row in rows], legacy)
                moved += len(rows)
            self._client.drop_collection(legacy, timeout=self._timeout)
        except MilvusException:
            if self._client.has_collection(legacy, timeout=self._timeout):
                raise
            return  # another replica sharing this Milvus finished the move first
        log.info("moved %d semantic-cache entries from %s to %s", moved, legacy, self.names.cache)

    def _base_schema(self, pk: str, pk_length: int, dynamic: bool = False) -> Any:
        schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=dynamic)
        schema.add_field(pk, DataType.VARCHAR, is_primary=True, max_length=pk_length)
        schema.add_field("tenant_key", DataType.VARCHAR, max_length=64)
        return schema

    def _vector_index(self, metric: str = "COSINE", index_type: str = "HNSW") -> Any:
        index = self._client.prepare_index_params()
        params = {"M": 16, "efConstruction": 200} if index_type == "HNSW" else {}
        index.add_index("vector", index_type=index_type, metric_type=metric, params=params)
        return index

    def _chunk_schema(self) -> tuple[Any, Any]:
        schema = self._base_schema("chunk_id", 128)
        schema.add_field("document_key", DataType.VARCHAR, max_length=64)
        schema.add_field("document_id", DataType.VARCHAR, max_length=MAX_LABEL_BYTES)
        schema.add_field("version", DataType.INT64)
        schema.add_field("position", DataType.INT64)
        schema.add_field("page", DataType.INT64)
        schema.add_field("heading", DataType.VARCHAR, max_length=MAX_LABEL_BYTES)
        schema.add_field("title", DataType.VARCHAR, max_length=MAX_LABEL_BYTES)
        schema.add_field("text", DataType.VARCHAR, max_length=MAX_TEXT_BYTES)
        schema.add_field("metadata", DataType.JSON)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=self.dimension)
        return schema, self._vector_index()

    def _document_schema(self) -> tuple[Any, Any]:
        schema = self._base_schema("document_key", 64)
        schema.add_field("document_id", DataType.VARCHAR, max_length=MAX_LABEL_BYTES)
        schema.add_field("title", DataType.VARCHAR, max_length=MAX_LABEL_BYTES)
        schema.add_field("mime_type", DataType.VARCHAR, max_length=256)
        schema.add_field("source", DataType.VARCHAR, max_length=4096)
        schema.add_field("metadata", DataType.JSON)
        schema.add_field("content_hash", DataType.VARCHAR, max_length=64)
        schema.add_field("version", DataType.INT64)
        schema.add_field("chunks", DataType.INT64)
        schema.add_field("updated_at_ms", DataType.INT64)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=_PLACEHOLDER_DIM)
        return schema, self._vector_index("L2", "FLAT")

    def _cache_schema(self) -> tuple[Any, Any]:
        # Dynamic: a later per-entry fact can be written without another collection; readers
        # default what an older row lacks.
        schema = self._base_schema("entry_id", 64, dynamic=True)
        # digest(tenant, model, params fingerprint): only entries in the same scope can match.
        schema.add_field("scope_key", DataType.VARCHAR, max_length=64)
        schema.add_field("prompt", DataType.VARCHAR, max_length=MAX_TEXT_BYTES)
        schema.add_field("answer", DataType.VARCHAR, max_length=MAX_TEXT_BYTES)
        schema.add_field("created_at_ms", DataType.INT64)
        schema.add_field("expires_at_ms", DataType.INT64)
        schema.add_field("cited", DataType.JSON)
        # The original answer's usage and finish reason (common.proto numbers), replayed by a hit.
        for name in _USAGE_FIELDS:
            schema.add_field(name, DataType.INT64)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=self.dimension)
        return schema, self._vector_index()

    # -- error mapping ---------------------------------------------------

    def _call(self, fn: Callable[[], T]) -> T:
        """Runs one Milvus call, turning "cannot reach Milvus" into UNAVAILABLE."""
        try:
            return fn()
        except MilvusException as exc:
            if exc.code in _UNREACHABLE_CODES or "connect" in str(exc.message).lower():
                raise DependencyUnavailable(f"Milvus at {self.uri} is unreachable: {exc.message}") from exc
            raise
        except grpc.RpcError as exc:
            raise DependencyUnavailable(f"Milvus at {self.uri} is unreachable: {exc}") from exc

    def require_model(self) -> None:
        """Raises FAILED_PRECONDITION when the collections were built by another embedding model."""
        if self.mismatch is not None:
            raise FailedPrecondition(self.mismatch)

    def _query(self, collection: str, filter_: str, fields: list[str], **kwargs: Any) -> list[dict[str, Any]]:
        return list(
            self._call(
                lambda: self._client.query(
                    collection,
                    filter=filter_,
                    output_fields=fields,
                    consistency_level=CONSISTENCY,
                    timeout=self._timeout,
                    **kwargs,
                )
            )
        )

    def _count(self, collection: str, filter_: str) -> int:
        rows = self._query(collection, filter_, ["count(*)"])
        return int(rows[0]["count(*)"]) if rows else 0

    def _upsert(self, collection: str, rows: list[dict[str, Any]]) -> None:
        for start in range(0, len(rows), _WRITE_BATCH):
            batch = rows[start : start + _WRITE_BATCH]
            self._call(functools.partial(self._client.upsert, collection, batch, timeout=self._timeout))

    def _settle(self, *collections: str) -> None:
        """Moves fresh rows from Milvus Lite's memtable into indexed segments.

        Milvus Lite searches rows still in its memtable by brute force in Python
        (about 0.4 s per search at 10k rows); a flush (tens of ms) puts them in a
        segment that gets an HNSW index in the background. A Milvus server indexes
        growing segments itself and dislikes frequent flushes, so it is left alone.
        """
        if is_lite_uri(self.uri):
            for collection in collections:
                self._call(functools.partial(self._client.flush, collection, timeout=self._timeout))

    def _delete(self, collection: str, filter_: str) -> None:
        self._call(lambda: self._client.delete(collection, filter=filter_, timeout=self._timeout))

    # -- documents -------------------------------------------------------

    def get_document(self, tenant: str, document_id: str) -> DocumentRecord | None:
        key = digest(tenant, document_id)
        rows = self._query(self.names.documents, f'document_key == "{key}"', ["*"])
        return _document_from_row(tenant, rows[0]) if rows else None

    def current_versions(self, tenant: str, document_keys: Iterable[str]) -> dict[str, int]:
        """document_key → current version, for the keys whose document exists (tombstones left out)."""
        keys = sorted(set(document_keys))
        if not keys:
            return {}
        tenant_key = digest(tenant)
        rows = self._query(
            self.names.documents,
            f'tenant_key == "{tenant_key}" and version > 0 and document_key in {json.dumps(keys)}',
            ["document_key", "version"],
        )
        return {row["document_key"]: int(row["version"]) for row in rows}

    def put_document(self, record: DocumentRecord) -> None:
        """Writes the record; for readers this is the instant the document's ``version`` becomes current."""
        row = {
            "document_key": digest(record.tenant, record.document_id),
            "tenant_key": digest(record.tenant),
            "document_id": record.document_id,
            "title": fit_bytes(record.title, MAX_LABEL_BYTES),
            "mime_type": record.mime_type,
            "source": fit_bytes(record.source, 4096),
            "metadata": record.metadata,
            "content_hash": record.content_hash,
            "version": record.version,
            "chunks": record.chunks,
            "updated_at_ms": record.updated_at_ms,
            "vector": [0.0] * _PLACEHOLDER_DIM,
        }
        self._upsert(self.names.documents, [row])
        self._settle(self.names.chunks, self.names.documents)

    def put_tombstone(self, record: DocumentRecord) -> None:
        """Marks the document deleted: from this write on, no search returns its chunks."""
        self.put_document(replace(record, version=-record.last_version, chunks=0, content_hash=""))

    def list_documents(self, tenant: str, after_id: str, limit: int) -> list[DocumentRecord]:
        """Up to ``limit`` documents with ids sorted after ``after_id`` (``""`` = from the start)."""
        base = f'tenant_key == "{digest(tenant)}" and version > 0'
        if after_id:
            base += f" and document_id > {milvus_string(after_id)}"
        # Milvus returns rows in no particular order and at most MAX_QUERY_WINDOW per query. When a
        # window comes back full, the `limit` smallest ids are all <= the limit-th smallest id in it,
        # so narrow the range to that and ask again (plain timed queries: an iterator could hang).
        condition = base
        while True:
            rows = self._query(self.names.documents, condition, ["document_id"], limit=MAX_QUERY_WINDOW)
            ids = sorted(row["document_id"] for row in rows)
            if len(ids) < MAX_QUERY_WINDOW or len(ids) <= limit:
                break
            condition = f"{base} and document_id <= {milvus_string(ids[limit - 1])}"
        page = ids[:limit]
        if not page:
            return []
        keys = [digest(tenant, d) for d in page]
        rows = self._query(self.names.documents, f"document_key in {json.dumps(keys)}", ["*"])
        return sorted((_document_from_row(tenant, row) for row in rows), key=lambda r: r.document_id)

    # -- chunks ----------------------------------------------------------

    def write_chunks(self, record: DocumentRecord, chunks: Sequence[ChunkRow], vectors: Vectors) -> None:
        """Stores ``chunks`` under ``record.version``; invisible until that version is made current."""
        self.require_model()
        document_key = digest(record.tenant, record.document_id)
        tenant_key = digest(record.tenant)
        rows = [
            {
                "chunk_id": f"{document_key}-v{record.version}-{chunk.position}",
                "tenant_key": tenant_key,
                "document_key": document_key,
                "document_id": record.document_id,
                "version": record.version,
                "position": chunk.position,
                "page": chunk.page,
                "heading": fit_bytes(chunk.heading, MAX_LABEL_BYTES),
                "title": fit_bytes(record.title, MAX_LABEL_BYTES),
                "text": fit_bytes(chunk.text, MAX_TEXT_BYTES),
                "metadata": record.metadata,
                "vector": vector.tolist(),
            }
            for chunk, vector in zip(chunks, vectors, strict=True)
        ]
        self._upsert(self.names.chunks, rows)

    def count_chunks(self, tenant: str, document_id: str, version: int | None = None) -> int:
        condition = f'document_key == "{digest(tenant, document_id)}"'
        if version is not None:
            condition += f" and version == {int(version)}"
        return self._count(self.names.chunks, condition)

    def delete_chunks(self, tenant: str, document_id: str, keep_version: int | None = None) -> int:
        """Deletes the document's chunks (all, or all but ``keep_version``); returns how many."""
        condition = f'document_key == "{digest(tenant, document_id)}"'
        if keep_version is not None:
            condition += f" and version != {int(keep_version)}"
        count = self._count(self.names.chunks, condition)
        if count:
            self._delete(self.names.chunks, condition)
        return count

    def search_chunks(
        self,
        tenant: str,
        vector: Vectors,
        limit: int,
        metadata_filter: Mapping[str, str],
        with_vectors: bool = False,
    ) -> list[ChunkHit]:
        self.require_model()
        condition = f'tenant_key == "{digest(tenant)}"'
        if metadata_filter:
            condition += " and " + metadata_condition(metadata_filter)
        fields = [
            "document_key",
            "document_id",
            "title",
            "text",
            "position",
            "page",
            "heading",
            "metadata",
            "version",
        ]
        if with_vectors:
            fields.append("vector")
        result = self._call(
            lambda: self._client.search(
                self.names.chunks,
                data=[vector.tolist()],
                limit=limit,
                filter=condition,
                output_fields=fields,
                search_params={"metric_type": "COSINE", "params": {"ef": max(self.search_ef, limit)}},
                consistency_level=CONSISTENCY,
                timeout=self._timeout,
            )
        )
        hits = []
        for hit in result[0] if result else []:
            entity = hit["entity"]
            hits.append(
                ChunkHit(
                    chunk_id=str(hit["chunk_id"] if "chunk_id" in hit else hit["id"]),
                    document_id=entity["document_id"],
                    document_key=entity["document_key"],
                    title=entity["title"],
                    text=entity["text"],
                    score=float(hit["distance"]),
                    position=int(entity["position"]),
                    page=int(entity["page"]),
                    heading=entity["heading"],
                    metadata=dict(entity.get("metadata") or {}),
                    document_version=int(entity["version"]),
                    vector=np.asarray(entity["vector"], dtype=np.float32) if with_vectors else None,
                )
            )
        return hits

    # -- semantic cache --------------------------------------------------

    def put_cache_entry(
        self,
        entry_id: str,
        tenant: str,
        scope_key: str,
        prompt: str,
        answer: str,
        vector: Vectors,
        created_at_ms: int,
        expires_at_ms: int,
        cited: Sequence[tuple[str, int]],
        usage: AnswerUsage = AnswerUsage(),
    ) -> None:
        self.require_model()
        row = {
            "entry_id": entry_id,
            "tenant_key": digest(tenant),
            "scope_key": scope_key,
            "prompt": prompt,
            "answer": answer,
            "created_at_ms": created_at_ms,
            "expires_at_ms": expires_at_ms,
            "cited": [[document_id, version] for document_id, version in cited],
            **{name: int(getattr(usage, name)) for name in _USAGE_FIELDS},
            "vector": vector.tolist(),
        }
        self._upsert(self.names.cache, [row])
        self._settle(self.names.cache)

    def search_cache(self, scope_key: str, vector: Vectors, now_ms: int, limit: int) -> list[CacheRow]:
        """Live entries in the scope nearest to ``vector``, most similar first."""
        self.require_model()
        result = self._call(
            lambda: self._client.search(
                self.names.cache,
                data=[vector.tolist()],
                limit=limit,
                filter=f'scope_key == "{scope_key}" and expires_at_ms > {int(now_ms)}',
                output_fields=["prompt", "answer", "created_at_ms", "expires_at_ms", "cited", *_USAGE_FIELDS],
                search_params={"metric_type": "COSINE", "params": {"ef": self.search_ef}},
                consistency_level=CONSISTENCY,
                timeout=self._timeout,
            )
        )
        rows = []
        for hit in result[0] if result else []:
            entity = hit["entity"]
            rows.append(
                CacheRow(
                    entry_id=str(hit["entry_id"] if "entry_id" in hit else hit["id"]),
                    prompt=entity["prompt"],
                    answer=entity["answer"],
                    similarity=float(hit["distance"]),
                    created_at_ms=int(entity["created_at_ms"]),
                    expires_at_ms=int(entity["expires_at_ms"]),
                    cited=tuple((str(d), int(v)) for d, v in entity.get("cited") or []),
                    usage=AnswerUsage(**{name: int(entity.get(name) or 0) for name in _USAGE_FIELDS}),
                )
            )
        return rows

    def delete_cache_entries(self, entry_ids: Sequence[str], collection: str | None = None) -> None:
        if entry_ids:
            self._delete(collection or self.names.cache, f"entry_id in {json.dumps(sorted(entry_ids))}")

    def purge_expired_cache(self, now_ms: int) -> None:
        self._delete(self.names.cache, f"expires_at_ms <= {int(now_ms)}")

    def count_cache_entries(self, tenant: str) -> int:
        return self._count(self.names.cache, f'tenant_key == "{digest(tenant)}"')


def _legacy_cache_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row of the older cache schema in the current one: its usage was never recorded, so 0."""
    moved = {key: value for key, value in row.items() if key in _LEGACY_CACHE_FIELDS}
    moved["vector"] = [float(x) for x in row["vector"]]
    return {**moved, **dict.fromkeys(_USAGE_FIELDS, 0)}


def _document_from_row(tenant: str, row: Mapping[str, Any]) -> DocumentRecord:
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
