"""The retriever's reads and writes on Milvus: documents and their versions, chunks and search, the semantic cache.

Every read asks for Strong consistency (``connection.py``), so a search issued
after an ingest returned sees that ingest's chunks. Filters only ever embed hex
digests and validated metadata keys (``filters.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

import numpy as np
from pymilvus import AnnSearchRequest, RRFRanker

from services.retriever.connection import CONSISTENCY, MilvusCollections
from services.retriever.embedder import Vectors
from services.retriever.filters import digest, metadata_condition, milvus_string
from services.retriever.records import (
    AnswerUsage,
    CacheRow,
    ChunkHit,
    ChunkRow,
    DocumentRecord,
    document_from_row,
)
from services.retriever.schema import (
    MAX_LABEL_BYTES,
    MAX_TEXT_BYTES,
    PLACEHOLDER_DIM,
    USAGE_FIELDS,
    fit_bytes,
)
from services.retriever.search_modes import SearchMode

# Milvus answers at most this many rows per query or search.
MAX_QUERY_WINDOW = 16_384
# Reciprocal rank fusion's constant: 60 is the value of the original paper and Milvus's default.
RRF_K = 60
_HIT_FIELDS = [
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


class MilvusStore(MilvusCollections):
    """Blocking access to the three collections; call it from worker threads."""

    # -- documents -------------------------------------------------------

    def get_document(self, tenant: str, document_id: str) -> DocumentRecord | None:
        key = digest(tenant, document_id)
        rows = self._query(self.names.documents, f'document_key == "{key}"', ["*"])
        return document_from_row(tenant, rows[0]) if rows else None

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
            "vector": [0.0] * PLACEHOLDER_DIM,
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
        return sorted((document_from_row(tenant, row) for row in rows), key=lambda r: r.document_id)

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
                "search_text": fit_bytes(chunk.search_text or chunk.text, MAX_TEXT_BYTES),
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
        mode: SearchMode,
        query_text: str,
        vector: Vectors,
        limit: int,
        metadata_filter: Mapping[str, str],
        with_vectors: bool = False,
        fused_limit: int | None = None,
    ) -> list[ChunkHit]:
        """The ``limit`` best chunks for the query in ``mode``, best first.

        ``fused_limit`` (hybrid only) keeps that many of the fusion of the two ``limit``-long
        lists instead of ``limit``: at ``2 * limit`` nothing either list found is cut, which
        lets a caller know every chunk among the dense ``limit`` nearest was seen.

        ``score`` is always the cosine similarity to ``vector`` (so ``min_score``
        means the same in every mode); ``retrieval_score`` is what the mode ranked by.
        Chunk vectors come back only when asked for or needed for that cosine (keyword and
        hybrid): fetching 384 floats a hit costs a dense search ~4x (8 → 30 ms at 10k chunks).
        """
        self.require_model()
        fields = [*_HIT_FIELDS, "vector"] if with_vectors or mode is not SearchMode.DENSE else _HIT_FIELDS
        condition = f'tenant_key == "{digest(tenant)}"'
        if metadata_filter:
            condition += " and " + metadata_condition(metadata_filter)
        dense = {"metric_type": "COSINE", "params": {"ef": max(self.search_ef, limit)}}
        keyword = {"metric_type": "BM25"}
        if mode is SearchMode.HYBRID:
            requests = [
                AnnSearchRequest([vector.tolist()], "vector", dense, limit, expr=condition),
                AnnSearchRequest([query_text], "sparse", keyword, limit, expr=condition),
            ]
            call = lambda: self._client.hybrid_search(  # noqa: E731
                self.names.chunks,
                requests,
                RRFRanker(RRF_K),
                limit=min(fused_limit or limit, MAX_QUERY_WINDOW),
                output_fields=fields,
                consistency_level=CONSISTENCY,
                timeout=self._timeout,
            )
        else:
            field, data, params = (
                ("vector", vector.tolist(), dense)
                if mode is SearchMode.DENSE
                else ("sparse", query_text, keyword)
            )
            call = lambda: self._client.search(  # noqa: E731
                self.names.chunks,
                data=[data],
                anns_field=field,
                limit=limit,
                filter=condition,
                output_fields=fields,
                search_params=params,
                consistency_level=CONSISTENCY,
                timeout=self._timeout,
            )
        result = self._call(call)
        return [_hit(hit, vector, mode) for hit in (result[0] if result else [])]

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
            **{name: int(getattr(usage, name)) for name in USAGE_FIELDS},
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
                output_fields=["prompt", "answer", "created_at_ms", "expires_at_ms", "cited", *USAGE_FIELDS],
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
                    usage=AnswerUsage(**{name: int(entity.get(name) or 0) for name in USAGE_FIELDS}),
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


def _hit(hit: Mapping[str, object], query: Vectors, mode: SearchMode) -> ChunkHit:
    entity: Mapping[str, object] = hit["entity"]  # type: ignore[assignment]
    vector = np.asarray(entity["vector"], dtype=np.float32) if "vector" in entity else None
    distance = float(hit["distance"])  # type: ignore[arg-type]
    # A dense search ranks by the cosine itself; the other modes' cosine is computed here.
    cosine = distance if vector is None else float(vector @ query)
    return ChunkHit(
        chunk_id=str(hit["chunk_id"] if "chunk_id" in hit else hit["id"]),
        document_id=str(entity["document_id"]),
        document_key=str(entity["document_key"]),
        title=str(entity["title"]),
        text=str(entity["text"]),
        score=cosine,
        position=int(entity["position"]),  # type: ignore[call-overload]
        page=int(entity["page"]),  # type: ignore[call-overload]
        heading=str(entity["heading"]),
        metadata=dict(entity.get("metadata") or {}),  # type: ignore[call-overload]
        document_version=int(entity["version"]),  # type: ignore[call-overload]
        vector=vector,
        # Milvus Lite reports BM25 negated (smaller is better); a server reports it as is.
        retrieval_score=abs(distance) if mode is SearchMode.KEYWORD else distance,
    )
