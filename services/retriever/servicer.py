"""The gRPC face of the retriever: protobuf in, corpus and cache calls on worker threads, protobuf out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.errors import DependencyUnavailable, InvalidArgument
from services.common.metadata import TENANT_KEY, metadata_value
from services.gen.llmmesh.v1 import common_pb2, retriever_pb2, retriever_pb2_grpc
from services.retriever import metrics
from services.retriever.corpus import Corpus, DocumentUpload, SearchQuery
from services.retriever.embedder import Embedder, Vectors
from services.retriever.records import AnswerUsage, ChunkHit, DocumentRecord
from services.retriever.semantic_cache import CacheScope, SemanticCache

Context = grpc.aio.ServicerContext[Any, Any]
MAX_TENANT_CHARS = 256
MAX_EMBED_TEXTS = 256


@dataclass(frozen=True)
class Backends:
    """What the servicer needs once startup finished."""

    corpus: Corpus
    cache: SemanticCache
    #: The model both embed with, for Embed.
    embedder: Embedder


def tenant_of(context: Context) -> str:
    tenant = metadata_value(context.invocation_metadata(), TENANT_KEY)
    if not tenant:
        raise InvalidArgument(TENANT_KEY, "metadata is required (the router sets it)")
    if len(tenant) > MAX_TENANT_CHARS:
        raise InvalidArgument(TENANT_KEY, f"must be at most {MAX_TENANT_CHARS} characters")
    return tenant


def document_info(record: DocumentRecord) -> retriever_pb2.DocumentInfo:
    return retriever_pb2.DocumentInfo(
        document_id=record.document_id,
        title=record.title,
        mime_type=record.mime_type,
        chunks=record.chunks,
        content_hash=record.content_hash,
        version=record.version,
        metadata=record.metadata,
        updated_at_ms=record.updated_at_ms,
    )


def retrieved_chunk(hit: ChunkHit) -> retriever_pb2.RetrievedChunk:
    return retriever_pb2.RetrievedChunk(
        chunk_id=hit.chunk_id,
        document_id=hit.document_id,
        title=hit.title,
        text=hit.text,
        score=hit.score,
        position=hit.position,
        page=hit.page,
        heading=hit.heading,
        metadata=hit.metadata,
        document_version=hit.document_version,
        retrieval_score=hit.retrieval_score,
        rerank_score=hit.rerank_score,
    )


class RetrieverServicer(retriever_pb2_grpc.RetrieverServicer):
    """Thin handlers; every blocking call (embedding, Milvus) runs off the event loop."""

    def __init__(self, max_document_bytes: int) -> None:
        self._max_document_bytes = max_document_bytes
        self._backends: Backends | None = None
        # Why we are not ready yet, for the UNAVAILABLE message.
        self.not_ready_reason = "the retriever is starting (loading the embedding model, opening Milvus)"

    def set_ready(self, backends: Backends) -> None:
        self._backends = backends

    @property
    def backends(self) -> Backends:
        if self._backends is None:
            raise DependencyUnavailable(self.not_ready_reason)
        return self._backends

    async def _receive_upload(
        self, request_iterator: AsyncIterator[retriever_pb2.IngestRequest]
    ) -> DocumentUpload:
        header: retriever_pb2.DocumentHeader | None = None
        pieces: list[bytes] = []
        size = 0
        async for message in request_iterator:
            part = message.WhichOneof("part")
            if part == "header":
                if header is not None:
                    raise InvalidArgument("header", "only the first message may carry a header")
                header = message.header
            elif part == "data":
                if header is None:
                    raise InvalidArgument("header", "the first message must be the document header")
                size += len(message.data)
                if size > self._max_document_bytes:
                    # Stop reading at once: an over-size upload is refused, not buffered.
                    raise InvalidArgument(
                        "data", f"document exceeds the {self._max_document_bytes}-byte limit"
                    )
                pieces.append(message.data)
        if header is None:
            raise InvalidArgument("header", "the stream carried no document header")
        return DocumentUpload(
            document_id=header.document_id,
            data=b"".join(pieces),
            mime_type=header.mime_type,
            title=header.title,
            source=header.source,
            metadata=dict(header.metadata),
        )

    async def Ingest(  # type: ignore[override]
        self, request_iterator: AsyncIterator[retriever_pb2.IngestRequest], context: Context
    ) -> retriever_pb2.IngestSummary:
        started = time.perf_counter()
        tenant = tenant_of(context)
        corpus = self.backends.corpus
        upload = await self._receive_upload(request_iterator)
        result = await asyncio.to_thread(corpus.ingest, tenant, upload)
        metrics.INGEST_SECONDS.observe(time.perf_counter() - started)
        if not result.unchanged:
            metrics.CHUNKS.inc(result.chunks)
        return retriever_pb2.IngestSummary(
            document_id=result.document_id,
            chunks=result.chunks,
            unchanged=result.unchanged,
            content_hash=result.content_hash,
            version=result.version,
            bytes=result.bytes,
        )

    async def Search(  # type: ignore[override]
        self, request: retriever_pb2.SearchRequest, context: Context
    ) -> retriever_pb2.SearchResponse:
        started = time.perf_counter()
        tenant = tenant_of(context)
        query = SearchQuery(
            text=request.query,
            top_k=request.top_k if request.HasField("top_k") else None,
            min_score=request.min_score if request.HasField("min_score") else None,
            metadata_filter=dict(request.metadata_filter),
            diversify=request.diversify,
            mode=int(request.mode),
            rerank=request.rerank if request.HasField("rerank") else None,
            rerank_candidates=request.rerank_candidates if request.HasField("rerank_candidates") else None,
        )
        result = await asyncio.to_thread(self.backends.corpus.find, tenant, query)
        metrics.SEARCH_SECONDS.observe(time.perf_counter() - started)
        return retriever_pb2.SearchResponse(
            chunks=[retrieved_chunk(hit) for hit in result.hits],
            mode=result.mode.value,  # type: ignore[arg-type]
            reranked=result.reranked,
            degraded=result.degraded,
        )

    async def DeleteDocument(  # type: ignore[override]
        self, request: retriever_pb2.DeleteDocumentRequest, context: Context
    ) -> retriever_pb2.DeleteDocumentResponse:
        tenant = tenant_of(context)
        deleted = await asyncio.to_thread(self.backends.corpus.delete, tenant, request.document_id)
        return retriever_pb2.DeleteDocumentResponse(chunks_deleted=deleted)

    async def ListDocuments(  # type: ignore[override]
        self, request: retriever_pb2.ListDocumentsRequest, context: Context
    ) -> retriever_pb2.ListDocumentsResponse:
        tenant = tenant_of(context)
        records, next_token = await asyncio.to_thread(
            self.backends.corpus.list, tenant, request.page_size, request.page_token
        )
        return retriever_pb2.ListDocumentsResponse(
            documents=[document_info(r) for r in records], next_page_token=next_token
        )

    async def CacheLookup(  # type: ignore[override]
        self, request: retriever_pb2.CacheLookupRequest, context: Context
    ) -> retriever_pb2.CacheLookupResponse:
        scope = CacheScope(tenant_of(context), request.model, request.params_fingerprint)
        threshold = request.threshold if request.HasField("threshold") else None
        hit = await asyncio.to_thread(self.backends.cache.lookup, scope, request.prompt, threshold)
        metrics.CACHE_LOOKUPS.labels("hit" if hit else "miss").inc()
        if hit is None:
            return retriever_pb2.CacheLookupResponse(hit=False)
        return retriever_pb2.CacheLookupResponse(
            hit=True,
            answer=hit.answer,
            similarity=hit.similarity,
            cached_prompt=hit.cached_prompt,
            entry_id=hit.entry_id,
            age_seconds=hit.age_seconds,
            usage=common_pb2.Usage(
                prompt_tokens=hit.usage.prompt_tokens,
                completion_tokens=hit.usage.completion_tokens,
                cached_prompt_tokens=hit.usage.cached_prompt_tokens,
            ),
            finish_reason=hit.usage.finish_reason,  # type: ignore[arg-type]
        )

    async def CacheStore(  # type: ignore[override]
        self, request: retriever_pb2.CacheStoreRequest, context: Context
    ) -> retriever_pb2.CacheStoreResponse:
        scope = CacheScope(tenant_of(context), request.model, request.params_fingerprint)
        cited = [(c.document_id, c.version) for c in request.cited]
        usage = AnswerUsage(
            prompt_tokens=request.usage.prompt_tokens,
            completion_tokens=request.usage.completion_tokens,
            cached_prompt_tokens=request.usage.cached_prompt_tokens,
            finish_reason=request.finish_reason,
        )
        entry_id = await asyncio.to_thread(
            self.backends.cache.store,
            scope,
            request.prompt,
            request.answer,
            request.ttl_seconds,
            cited,
            usage,
        )
        return retriever_pb2.CacheStoreResponse(entry_id=entry_id)

    async def Embed(  # type: ignore[override]
        self, request: retriever_pb2.EmbedRequest, context: Context
    ) -> retriever_pb2.EmbedResponse:
        if not 1 <= len(request.texts) <= MAX_EMBED_TEXTS:
            raise InvalidArgument("texts", f"must hold 1..{MAX_EMBED_TEXTS} texts, got {len(request.texts)}")
        embedder = self.backends.embedder
        texts = list(request.texts)
        truncate = request.truncate if request.HasField("truncate") else True
        vectors, tokens = await asyncio.to_thread(_embed_counted, embedder, texts, truncate)
        return retriever_pb2.EmbedResponse(
            embeddings=[retriever_pb2.Embedding(values=row.tolist()) for row in vectors],
            model=embedder.model_name,
            tokens=tokens,
        )


def _embed_counted(embedder: Embedder, texts: list[str], truncate: bool) -> tuple[Vectors, int]:
    """The vectors and the tokens the model read (each text cut at its input length, or, without
    ``truncate``, refused when longer: a silently cut text's vector says nothing of its end)."""
    counts = [embedder.input_tokens(t) for t in texts]
    if not truncate:
        for i, count in enumerate(counts):
            if count > embedder.max_tokens:
                raise InvalidArgument(
                    f"texts[{i}]",
                    f"{count} tokens, more than the {embedder.max_tokens}-token input of "
                    f"{embedder.model_name}; shorten or split it",
                )
    return embedder.embed(texts), sum(min(c, embedder.max_tokens) for c in counts)
