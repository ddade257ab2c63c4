"""The Milvus connection under the store: one client, collections made or adopted, errors mapped, timed calls.

One code path for Milvus Lite (a local ``*.db`` path, served in-process) and a
Milvus server (``http://…``). Every read asks for Strong consistency, so a
search issued after an ingest returned sees that ingest's chunks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
from pymilvus import MilvusClient
from pymilvus.client.types import LoadState
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


def has_credentials(uri: str) -> bool:
    """Whether ``uri`` may carry credentials: a server URL with an ``@`` (``user:password@``,
    or a token alone as ``token@``). A ``*.db`` path is a file name, never a secret."""
    return "@" in uri and not is_lite_uri(uri)


def masked_milvus_uri(uri: str) -> str:
    """``uri`` fit to print: ``http://root:***@host:19530``, or ``http://***@host:19530``.

    pymilvus reads ``user:password`` from the URI's userinfo, and a user alone as a token (an
    API key): either is a secret. Unmasked, the URI reached logs and, through the router,
    every tenant's error messages. A URL with an ``@`` elsewhere (a password with an unescaped
    ``/``) is shown as ``***`` whole. (``services.common.redact.masked_url`` masks a password
    only: to pymilvus a user without one is a token, so it is masked here too.)
    """
    if not has_credentials(uri):
        return uri
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "***"
    if "@" not in parts.netloc:
        return "***"
    userinfo, _, hostinfo = parts.netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    shown = f"{user}:***" if colon and user else "***"
    return parts._replace(netloc=f"{shown}@{hostinfo}").geturl()


def check_milvus_uri(uri: str) -> str:
    """The URI if usable: a ``*.db`` path (Milvus Lite) or an http(s)/tcp/unix URL."""
    if is_lite_uri(uri) or uri.startswith(("http://", "https://", "tcp://", "unix:")):
        return uri
    raise ValueError(
        "--milvus-uri must be a path ending in .db (Milvus Lite) or http(s)://host:port, "
        f"got {masked_milvus_uri(uri)!r}"
    )


# pymilvus logs every failed call itself (an ERROR with two tracebacks, and a WARNING for each
# reconnect); the health check's calls fail every few seconds while Milvus is away, and say so
# in one line of ours per change instead. Only the check's own thread is quieted.
_QUIET = threading.local()
_PYMILVUS_LOGGERS = (
    "pymilvus.decorators",
    "pymilvus.client.connection_manager",
    "pymilvus.client.grpc_handler",
)


class _QuietThread(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_QUIET, "on", False)


_QUIET_FILTER = _QuietThread()


@contextlib.contextmanager
def _pymilvus_quiet() -> Iterator[None]:
    for name in _PYMILVUS_LOGGERS:
        logging.getLogger(name).addFilter(_QUIET_FILTER)  # once: a filter already there is kept
    _QUIET.on = True
    try:
        yield
    finally:
        _QUIET.on = False


def _secrets_of(uri: str, token: str) -> tuple[str, ...]:
    """The strings that must never be printed: the URI itself when it has userinfo, its
    password (or its user, when that alone is the token), and the token; longest first."""
    found = {token} if token else set()
    if has_credentials(uri):
        found.add(uri)
        with contextlib.suppress(ValueError):
            parts = urlsplit(uri)
            found.add(parts.password or parts.username or "")
    return tuple(sorted((s for s in found if s), key=len, reverse=True))


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
        token: str = "",
    ) -> None:
        """``token``: ``user:password`` or an API key for a Milvus with auth on (it wins over
        credentials in ``uri``); never printed, nor is the userinfo of ``uri``."""
        check_milvus_uri(uri)
        if search_ef < 1:
            raise ValueError(f"--search-ef must be >= 1, got {search_ef}")
        # HNSW candidate list per search: larger finds more true neighbours, more slowly.
        self.search_ef = search_ef
        if is_lite_uri(uri):
            uri = str(Path(uri).expanduser())
            Path(uri).resolve().parent.mkdir(parents=True, exist_ok=True)
        self.uri = uri
        #: What messages and logs name: the URI without its credentials.
        self.shown_uri = masked_milvus_uri(uri)
        self._secrets = _secrets_of(uri, token)
        self.model_name = model_name
        self.dimension = dimension
        self.names = names or CollectionNames.with_prefix("llmmesh")
        self._timeout = timeout_s
        # Set when existing collections were built by another model: vector calls are refused.
        self.mismatch: str | None = None
        self._client = self._call(lambda: MilvusClient(uri=uri, token=token, timeout=timeout_s))
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

    def ping(self) -> None:
        """The health check: Milvus answers and the three collections are loaded (one cheap
        round trip each).

        Raises DependencyUnavailable when Milvus cannot be reached or a collection cannot be
        searched yet. pymilvus reconnects by itself after an outage; a Milvus that came back
        without the collections loaded (Milvus Lite's server forgets it on a restart, and every
        search then failed "call load() before search") gets them loaded again here.
        """
        loaded = []
        with _pymilvus_quiet():
            for name in (self.names.chunks, self.names.documents, self.names.cache):
                found = self._call(
                    functools.partial(self._client.get_load_state, name, timeout=self._timeout)
                )
                state = found["state"]
                if state == LoadState.Loaded:
                    continue
                if state != LoadState.NotLoad:  # Loading (a large collection after a restart), NotExist
                    raise DependencyUnavailable(
                        f"Milvus at {self.shown_uri}: collection {name} is {state.name}"
                    )
                self._call(functools.partial(self._client.load_collection, name, timeout=self._timeout))
                loaded.append(name)
        if loaded:
            log.warning("loaded %s again: Milvus had them unloaded (restarted?)", ", ".join(loaded))

    def _call(self, fn: Callable[[], T]) -> T:
        """Runs one Milvus call, turning "cannot reach Milvus" into UNAVAILABLE.

        Every message names the URI without its credentials (``shown_uri``): the router hands
        these messages to tenants, and the retriever logs them.
        """
        try:
            return fn()
        except MilvusException as exc:
            reason = self._scrub(str(exc.message))
            # A message that quoted a credential (pymilvus's "uri: … is illegal") must not reach
            # a log through the exception chain either.
            cause = exc if reason == str(exc.message) else None
            if exc.code in _UNREACHABLE_CODES or "connect" in reason.lower():
                raise DependencyUnavailable(f"Milvus at {self.shown_uri} is unreachable: {reason}") from cause
            if cause is None:
                raise MilvusException(code=exc.code, message=reason) from None
            raise
        except grpc.RpcError as exc:
            reason = self._scrub(str(exc))
            cause = exc if reason == str(exc) else None
            raise DependencyUnavailable(f"Milvus at {self.shown_uri} is unreachable: {reason}") from cause

    def _scrub(self, text: str) -> str:
        """``text`` with every credential this connection holds shown as ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

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
