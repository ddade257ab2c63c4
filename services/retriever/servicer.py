"""The gRPC face of the retriever: protobuf in, corpus and cache calls on worker threads, protobuf out."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from services.common.errors import DependencyUnavailable, InvalidArgument, Overloaded
from services.common.metadata import TENANT_KEY, metadata_value
from services.gen.llmmesh.v1 import common_pb2, retriever_pb2, retriever_pb2_grpc
from services.retriever import metrics
from services.retriever.corpus import Corpus, DocumentUpload, SearchQuery, encode_page_token
from services.retriever.embedder import Embedder, Vectors
from services.retriever.records import AnswerUsage, ChunkHit, DocumentRecord
from services.retriever.semantic_cache import CacheScope, SemanticCache

Context = grpc.aio.ServicerContext[Any, Any]
MAX_TENANT_CHARS = 256
MAX_EMBED_TEXTS = 256
#: Threads for Ingest and DeleteDocument (``--ingest-workers``), apart from the reads' threads.
DEFAULT_INGEST_WORKERS = 2
#: Writes that may wait for one of those threads; past that, RESOURCE_EXHAUSTED (retry later).
MAX_QUEUED_WRITES = 16
#: A Search or ListDocuments response stops growing here, well under gRPC's 4 MiB message limit
#: (--max-message-bytes): documents stored before metadata was capped can still carry 64 KiB.
MAX_RESPONSE_BYTES = 3 * 1024 * 1024
T = TypeVar("T")
M = TypeVar("M", retriever_pb2.RetrievedChunk, retriever_pb2.DocumentInfo)


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

    def __init__(
        self,
        max_document_bytes: int,
        ingest_workers: int = DEFAULT_INGEST_WORKERS,
        max_queued_writes: int = MAX_QUEUED_WRITES,
    ) -> None:
        if ingest_workers < 1:
            raise ValueError(f"--ingest-workers must be >= 1, got {ingest_workers}")
        self._max_document_bytes = max_document_bytes
        self._backends: Backends | None = None
        # Why we are not ready yet, for the UNAVAILABLE message.
        self.not_ready_reason = "the retriever is starting (loading the embedding model, opening Milvus)"
        # Writes (a PDF parse of up to --max-parse-seconds, a wait for another replica's lease)
        # run on their own threads: on asyncio's default executor, shared with the reads, six
        # slow parses took every thread and Search and CacheLookup waited behind them.
        self._writes = ThreadPoolExecutor(ingest_workers, thread_name_prefix="retriever-write")
        self._ingest_workers = ingest_workers
        self._max_queued_writes = max_queued_writes
        self._writes_in_flight = 0  # running and waiting; only touched on the event loop

    def close(self) -> None:
        self._writes.shutdown(wait=False, cancel_futures=True)

    async def _write(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` on a write thread, queued (FIFO) while all are busy, refused past the queue."""
        if self._writes_in_flight >= self._ingest_workers + self._max_queued_writes:
            raise Overloaded(
                f"{self._writes_in_flight} ingests and deletes are running or queued on this "
                "retriever; retry later"
            )
        self._writes_in_flight += 1
        try:
            # As asyncio.to_thread does: the call sees this request's context variables.
            bound = functools.partial(contextvars.copy_context().run, call, *args)
            return await asyncio.get_running_loop().run_in_executor(self._writes, bound)
        finally:
            self._writes_in_flight -= 1

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
        result = await self._write(corpus.ingest, tenant, upload)
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
        chunks = _fitting([retrieved_chunk(hit) for hit in result.hits])
        degraded = result.degraded
        if len(chunks) < len(result.hits):
            cut = f"{len(chunks)} of {len(result.hits)} results: more would pass the message size limit"
            degraded = f"{degraded}; {cut}" if degraded else cut
        return retriever_pb2.SearchResponse(
            chunks=chunks,
            mode=result.mode.value,  # type: ignore[arg-type]
            reranked=result.reranked,
            degraded=degraded,
        )

    async def DeleteDocument(  # type: ignore[override]
        self, request: retriever_pb2.DeleteDocumentRequest, context: Context
    ) -> retriever_pb2.DeleteDocumentResponse:
        tenant = tenant_of(context)
        deleted = await self._write(self.backends.corpus.delete, tenant, request.document_id)
        return retriever_pb2.DeleteDocumentResponse(chunks_deleted=deleted)

    async def ListDocuments(  # type: ignore[override]
        self, request: retriever_pb2.ListDocumentsRequest, context: Context
    ) -> retriever_pb2.ListDocumentsResponse:
        tenant = tenant_of(context)
        records, next_token = await asyncio.to_thread(
            self.backends.corpus.list, tenant, request.page_size, request.page_token
        )
        documents = _fitting([document_info(r) for r in records])
        if len(documents) < len(records):
            # A shorter page, not an error: the next one starts after the last document sent.
            next_token = encode_page_token(documents[-1].document_id)
        return retriever_pb2.ListDocumentsResponse(documents=documents, next_page_token=next_token)

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
        texts = list(request.texts)
        for i, text in enumerate(texts):
            if not text.strip():  # the contract says none empty; a blank text's vector means nothing
                raise InvalidArgument(f"texts[{i}]", "must not be empty or only whitespace")
        embedder = self.backends.embedder
        truncate = request.truncate if request.HasField("truncate") else True
        vectors, tokens = await asyncio.to_thread(_embed_counted, embedder, texts, truncate)
        return retriever_pb2.EmbedResponse(
            embeddings=[retriever_pb2.Embedding(values=row.tolist()) for row in vectors],
            model=embedder.model_name,
            tokens=tokens,
        )


def _fitting(messages: list[M]) -> list[M]:
    """The leading ``messages`` whose encoding fits MAX_RESPONSE_BYTES (at least one)."""
    size = 0
    for i, message in enumerate(messages):
        size += message.ByteSize() + 8  # the field's tag and length prefix, generously
        if i and size > MAX_RESPONSE_BYTES:
            return messages[:i]
    return messages


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
