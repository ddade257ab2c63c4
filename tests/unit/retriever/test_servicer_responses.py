"""Search and ListDocuments answer within gRPC's message limit at every documented maximum."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import InvalidArgument
from services.common.metadata import TENANT_KEY
from services.gen.llmmesh.v1 import retriever_pb2 as pb
from services.retriever.corpus import (
    MAX_DOCUMENT_ID_CHARS,
    MAX_PAGE_SIZE,
    decode_page_token,
    encode_page_token,
)
from services.retriever.records import ChunkHit, DocumentRecord
from services.retriever.schema import MAX_LABEL_BYTES, MAX_TEXT_BYTES
from services.retriever.search import MAX_METADATA_BYTES, MAX_TOP_K, SearchQuery, SearchResult
from services.retriever.search_modes import SearchMode
from services.retriever.servicer import Backends, RetrieverServicer

# gRPC's default --max-message-bytes: a response past it fails as RESOURCE_EXHAUSTED.
GRPC_LIMIT = 4 * 1024 * 1024
# The largest metadata a document may carry: keys and values of MAX_METADATA_BYTES together.
FULL_METADATA = {f"k{i:02d}": "v" * (MAX_METADATA_BYTES // 8 - 3) for i in range(8)}


class Context:
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TENANT_KEY, "acme"),)


class LargestCorpus:
    """Documents and hits with every field at its largest: ids, titles, metadata, chunk text."""

    def __init__(self, documents: int) -> None:
        self.ids = sorted(f"{i:05d}".ljust(MAX_DOCUMENT_ID_CHARS, "d") for i in range(documents))

    def record(self, document_id: str) -> DocumentRecord:
        return DocumentRecord(
            "acme", document_id, "t" * MAX_LABEL_BYTES, "text/plain", "", FULL_METADATA, "0" * 64, 1, 1, 0
        )

    def list(self, tenant: str, page_size: int, page_token: str) -> tuple[list[DocumentRecord], str]:
        after = decode_page_token(page_token)
        rest = [d for d in self.ids if d > after]
        page = rest[:page_size]
        return [self.record(d) for d in page], encode_page_token(page[-1]) if len(rest) > page_size else ""

    def find(self, tenant: str, query: SearchQuery) -> SearchResult:
        hits = [
            ChunkHit(
                f"c{i}", self.ids[0], "k", "t" * MAX_LABEL_BYTES, "x" * MAX_TEXT_BYTES, 0.5, i, 0,
                "h" * MAX_LABEL_BYTES, FULL_METADATA, 1,
            )
            for i in range(query.limit)
        ]  # fmt: skip
        return SearchResult(hits, SearchMode.HYBRID)


def servicer_over(corpus: LargestCorpus) -> RetrieverServicer:
    servicer = RetrieverServicer(1 << 20)
    servicer.set_ready(Backends(corpus=corpus, cache=None, embedder=None))  # type: ignore[arg-type]
    return servicer


def test_a_full_page_of_documents_with_the_largest_metadata_is_split_not_refused() -> None:
    # 1,000 documents of 64 × 1,024-character values made a 66 MB page: RESOURCE_EXHAUSTED.
    # Even at the new 8 KiB cap a full page is ~10 MB, so a page stops short and says where to go on.
    corpus = LargestCorpus(2 * MAX_PAGE_SIZE + 7)
    servicer = servicer_over(corpus)

    async def pages() -> list[str]:
        seen: list[str] = []
        token = ""
        while True:
            request = pb.ListDocumentsRequest(page_size=MAX_PAGE_SIZE, page_token=token)
            response = await servicer.ListDocuments(request, Context())
            assert 0 < response.ByteSize() <= GRPC_LIMIT
            seen += [d.document_id for d in response.documents]
            token = response.next_page_token
            if not token:
                return seen

    assert asyncio.run(pages()) == corpus.ids  # every document once, in order


def test_a_search_for_the_most_results_answers_within_the_message_limit() -> None:
    servicer = servicer_over(LargestCorpus(1))
    response = asyncio.run(servicer.Search(pb.SearchRequest(query="pump", top_k=MAX_TOP_K), Context()))
    assert 0 < len(response.chunks) < MAX_TOP_K
    assert response.ByteSize() <= GRPC_LIMIT
    assert "message size limit" in response.degraded
    assert [c.chunk_id for c in response.chunks] == [f"c{i}" for i in range(len(response.chunks))]


def test_embed_refuses_an_empty_or_blank_text_naming_it() -> None:
    # The contract says "none empty", but blank texts were embedded into meaningless vectors.
    servicer = servicer_over(LargestCorpus(1))
    for texts in (["a question", ""], ["a question", "  \n\t"]):
        with pytest.raises(InvalidArgument) as refused:
            asyncio.run(servicer.Embed(pb.EmbedRequest(texts=texts), Context()))
        assert refused.value.field == "texts[1]"
