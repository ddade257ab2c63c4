"""The Milvus connection under the store: one client, collections made or adopted, errors mapped, timed calls.

One code path for Milvus Lite (a local ``*.db`` path, served in-process) and a
Milvus server (``http://…``). Every read asks for Strong consistency, so a
search issued after an ingest returned sees that ingest's chunks.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import grpc
from pymilvus import MilvusClient
from pymilvus.exceptions import MilvusException

from services.common.errors import DependencyUnavailable, FailedPrecondition
from services.retriever.schema import (
    DIMENSION_PROPERTY,
    MODEL_PROPERTY,
    CollectionNames,
    cache_schema,
    chunk_schema,
    document_schema,
    legacy_cache_row,
    legacy_chunk_row,
)

log = logging.getLogger("llmmesh.retriever.store")

T = TypeVar("T")

CONSISTENCY = "Strong"
_WRITE_BATCH = 256
# Cache entries moved per round when an older cache collection is adopted (rows carry vectors).
_MIGRATION_BATCH = 512
_UNREACHABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, 2}


def is_lite_uri(uri: str) -> bool:
    return uri.endswith(".db")


def check_milvus_uri(uri: str) -> str:
    """The URI if usable: a ``*.db`` path (Milvus Lite) or an http(s)/tcp/unix URL."""
    if is_lite_uri(uri) or uri.startswith(("http://", "https://", "tcp://", "unix:")):
        return uri
    raise ValueError(
        f"--milvus-uri must be a path ending in .db (Milvus Lite) or http(s)://host:port, got {uri!r}"
    )


class MilvusCollections:
    """The three collections, opened (made when missing) and checked against the embedding model.

    Blocking: call it from worker threads. ``MilvusStore`` adds the reads and writes.
    """

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
        builders: tuple[tuple[str, Callable[[], tuple[Any, Any]]], ...] = (
            (self.names.chunks, lambda: chunk_schema(self.dimension)),
            (self.names.documents, document_schema),
            (self.names.cache, lambda: cache_schema(self.dimension)),
        )
        for name, builder in builders:
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
        moves = (
            (self.names.legacy_cache, self.names.cache, "entry_id", legacy_cache_row),
            (self.names.legacy_chunks, self.names.chunks, "chunk_id", legacy_chunk_row),
        )
        for legacy, target, key, convert in moves:
            if legacy is not None and legacy in existing:
                self._adopt_legacy(legacy, target, key, convert, expected)

    def _adopt_legacy(
        self,
        legacy: str,
        target: str,
        key: str,
        convert: Callable[[Mapping[str, Any]], dict[str, Any]],
        expected: Mapping[str, str],
    ) -> None:
        """Moves the rows of an older-schema collection into the current one, then drops it.

        Milvus Lite cannot add a field to a collection, so a new schema is a new
        collection. Old cache entries keep hitting, with usage 0 (it was never
        recorded); old chunks keep their vectors and versions and gain the keyword
        field, so documents need no re-ingest. Rows are written to the new
        collection before they are deleted from the old one and the old one is
        dropped only when empty, so a crash midway loses nothing: the next start
        carries on (rewriting a row already moved is an idempotent upsert).
        """
        found = self._client.describe_collection(legacy, timeout=self._timeout).get("properties", {})
        if {k: str(found.get(k, "")) for k in expected} != dict(expected):
            # Its vectors come from another embedding model: useless here, and not ours to delete.
            log.warning("left %s in place: it was built with another embedding model", legacy)
            return
        moved = 0
        try:
            self._client.load_collection(legacy, timeout=self._timeout)
            while rows := self._query(legacy, f'{key} != ""', ["*"], limit=_MIGRATION_BATCH):
                self._upsert(target, [convert(row) for row in rows])
                self._settle(target)
                moved_ids = sorted(str(row[key]) for row in rows)
                self._delete(legacy, f"{key} in {json.dumps(moved_ids)}")
                moved += len(rows)
            self._client.drop_collection(legacy, timeout=self._timeout)
        except MilvusException:
            if self._client.has_collection(legacy, timeout=self._timeout):
                raise
            return  # another replica sharing this Milvus finished the move first
        log.info("moved %d rows from %s to %s", moved, legacy, target)

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
