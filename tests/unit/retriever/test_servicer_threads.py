"""Writes run on their own threads: ingests blocked in a slow parse never hold up a search."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from services.common.errors import Overloaded
from services.common.metadata import TENANT_KEY
from services.gen.llmmesh.v1 import retriever_pb2 as pb
from services.retriever.corpus import DocumentUpload, IngestResult, SearchQuery, SearchResult
from services.retriever.search_modes import SearchMode
from services.retriever.servicer import Backends, RetrieverServicer


class BlockedIngestCorpus:
    """Every ingest waits until ``release`` is set, as a PDF parse near its deadline does."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.running = 0
        self._lock = threading.Lock()

    def ingest(self, tenant: str, upload: DocumentUpload) -> IngestResult:
        with self._lock:
            self.running += 1
        self.release.wait()
        return IngestResult(upload.document_id, 1, False, "0" * 64, 1, len(upload.data))

    def find(self, tenant: str, query: SearchQuery) -> SearchResult:
        return SearchResult([], SearchMode.HYBRID)


class Context:
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TENANT_KEY, "acme"),)


async def upload(document_id: str) -> AsyncIterator[pb.IngestRequest]:
    yield pb.IngestRequest(header=pb.DocumentHeader(document_id=document_id, mime_type="text/plain"))
    yield pb.IngestRequest(data=b"slow document")


def serving(corpus: BlockedIngestCorpus, **options: Any) -> RetrieverServicer:
    servicer = RetrieverServicer(1 << 20, **options)
    servicer.set_ready(Backends(corpus=corpus, cache=None, embedder=None))  # type: ignore[arg-type]
    return servicer


async def wait_until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_a_search_answers_while_ingests_hold_every_write_thread() -> None:
    # Before, every handler ran on asyncio's default executor (6 threads on 2 CPUs): six slow
    # PDF parses took them all and Search waited 10 s. The loop here gets a 4-thread default
    # executor, so 8 blocked ingests would fill it on any machine.
    async def scenario() -> None:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(4))
        corpus = BlockedIngestCorpus()
        servicer = serving(corpus)
        ingests = [asyncio.create_task(servicer.Ingest(upload(f"d{i}"), Context())) for i in range(8)]
        try:
            await asyncio.sleep(0)  # every ingest has handed its work to a thread or a queue
            await wait_until(lambda: corpus.running >= 2)
            search = asyncio.create_task(servicer.Search(pb.SearchRequest(query="pump"), Context()))
            # The timeout only ends the test when the search is stuck; it passes as soon as it answers.
            done, _ = await asyncio.wait({search}, timeout=60)
            assert search in done, "Search waited for the blocked ingests"
            assert search.result().mode == pb.SEARCH_MODE_HYBRID
            assert not any(task.done() for task in ingests), "the ingests are still blocked"
        finally:
            corpus.release.set()
        summaries = await asyncio.gather(*ingests)  # the queued ones ran once threads came free
        assert sorted(s.document_id for s in summaries) == sorted(f"d{i}" for i in range(8))
        servicer.close()

    asyncio.run(scenario())


def test_writes_past_the_queue_are_refused_as_resource_exhausted() -> None:
    async def scenario() -> None:
        corpus = BlockedIngestCorpus()
        servicer = serving(corpus, ingest_workers=1, max_queued_writes=1)
        running = asyncio.create_task(servicer.Ingest(upload("a"), Context()))
        queued = asyncio.create_task(servicer.Ingest(upload("b"), Context()))
        try:
            await wait_until(lambda: corpus.running == 1)
            with pytest.raises(Overloaded, match="retry later"):
                await servicer.Ingest(upload("c"), Context())
        finally:
            corpus.release.set()
        assert [(await t).document_id for t in (running, queued)] == ["a", "b"]
        servicer.close()

    asyncio.run(scenario())
