"""Startup and shutdown of the retriever: load the embedding model, open Milvus, then report SERVING."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import grpc
import redis

from services.common.errors import DependencyUnavailable
from services.common.server import HealthReporter
from services.gen.llmmesh.v1 import retriever_pb2_grpc
from services.retriever.chunking import ChunkingPolicy, TokenChunker
from services.retriever.config import RetrieverConfig
from services.retriever.corpus import Corpus
from services.retriever.document_locks import DocumentLocks, LocalLocks, RedisLocks
from services.retriever.embedder import Embedder
from services.retriever.milvus_health import MilvusHealthWatcher
from services.retriever.rerank import load_reranker
from services.retriever.schema import CollectionNames
from services.retriever.semantic_cache import SemanticCache
from services.retriever.servicer import Backends, RetrieverServicer
from services.retriever.store import MilvusStore

log = logging.getLogger("llmmesh.retriever")
# Between attempts to reach Milvus while starting; health stays NOT_SERVING meanwhile.
_RETRY_SECONDS = (0.5, 1.0, 2.0, 5.0)


class RetrieverRuntime:
    """The ServiceRuntime the shared bootstrap drives."""

    service_names: Sequence[str] = ("llmmesh.v1.Retriever",)

    def __init__(self, config: RetrieverConfig) -> None:
        self.config = config
        self.servicer = RetrieverServicer(config.max_document_bytes, config.ingest_workers)
        self._store: MilvusStore | None = None
        self._lock_client: Any = None  # Redis for document write leases, when configured
        self._watcher: MilvusHealthWatcher | None = None

    def register(self, server: grpc.aio.Server) -> None:
        retriever_pb2_grpc.add_RetrieverServicer_to_server(self.servicer, server)

    async def start(self, health: HealthReporter) -> None:
        config = self.config
        embedder = await asyncio.to_thread(
            Embedder, config.embedding_model, config.embedding_dimension, config.device
        )
        policy = ChunkingPolicy(config.chunk_tokens, config.chunk_overlap_tokens)
        if policy.max_tokens > embedder.max_tokens:
            raise ValueError(
                f"--chunk-tokens {policy.max_tokens} exceeds the model's {embedder.max_tokens}-token input"
            )
        self._store = await self._open_store(embedder)
        if self._store.mismatch:
            log.error("%s", self._store.mismatch)
        chunker = TokenChunker(embedder.token_spans, policy)
        # A reranker that cannot be loaded is logged and noted on searches, never fatal.
        reranker, unavailable = await asyncio.to_thread(
            load_reranker, config.rerank_model, embedder, config.device
        )
        corpus = Corpus(
            self._store,
            embedder,
            chunker,
            locks=self._document_locks(),
            reranker=reranker,
            reranker_unavailable=unavailable,
            max_parse_seconds=config.max_parse_seconds,
        )
        self.servicer.set_ready(
            Backends(
                corpus=corpus,
                cache=SemanticCache(self._store, embedder, config.cache_threshold, config.cache_ttl_seconds),
                embedder=embedder,
            )
        )
        await health.set_serving(True)
        # From now on health follows Milvus: NOT_SERVING while it cannot be reached.
        self._watcher = MilvusHealthWatcher(
            self._store.ping, health, config.milvus_check_seconds, config.milvus_timeout_seconds
        )
        self._watcher.start()

    def _document_locks(self) -> DocumentLocks:
        config = self.config
        if config.redis_url is None:
            return LocalLocks()
        common: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 2.0}
        client: Any = (
            redis.RedisCluster.from_url(config.redis_url, **common)
            if config.redis_cluster
            else redis.Redis.from_url(config.redis_url, **common)
        )
        log.info("document writes take leases in Redis (%s)", "cluster" if config.redis_cluster else "single")
        self._lock_client = client
        return RedisLocks(client, config.document_lease_seconds, config.document_lock_wait_seconds)

    async def _open_store(self, embedder: Embedder) -> MilvusStore:
        names = CollectionNames.with_prefix(self.config.collection_prefix)
        attempt = 0
        while True:
            try:
                return await asyncio.to_thread(
                    MilvusStore,
                    self.config.milvus_uri,
                    embedder.model_name,
                    embedder.dimension,
                    names,
                    self.config.milvus_timeout_seconds,
                    self.config.search_ef,
                    token=self.config.milvus_token or "",
                )
            except DependencyUnavailable as exc:
                # Keep trying (NOT_SERVING); calls meanwhile get UNAVAILABLE with this reason.
                self.servicer.not_ready_reason = str(exc)
                delay = _RETRY_SECONDS[min(attempt, len(_RETRY_SECONDS) - 1)]
                log.warning("%s; retrying in %.1fs", exc, delay)
                attempt += 1
                await asyncio.sleep(delay)

    async def drain(self) -> None:
        """Nothing to refuse early: in-flight RPCs finish within the server's grace period.

        The Milvus check stops here: health stays NOT_SERVING from SIGTERM on anyway.
        """
        if self._watcher is not None:
            await self._watcher.stop()

    async def close(self) -> None:
        if self._watcher is not None:
            # A check still on its thread finishes (bounded by the Milvus timeout) before the
            # client it uses is closed.
            await self._watcher.stop(wait_s=self.config.milvus_timeout_seconds)
            self._watcher = None
        self.servicer.close()
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
            self._store = None
        if self._lock_client is not None:
            await asyncio.to_thread(self._lock_client.close)
            self._lock_client = None
