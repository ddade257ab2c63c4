"""Search modes, the relevance reranker and the RAG minimum score, on a real retriever over Milvus Lite.

A small fixture of look-alike and unrelated documents, ingested once per module
into the real service with the real embedding model. A reranker that cannot be
loaded is checked in-process on the same search path: searches still answer, with `degraded`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common.metadata import TENANT_KEY
from services.gen.llmmesh.v1 import retriever_pb2 as pb
from services.gen.llmmesh.v1 import retriever_pb2_grpc, router_pb2
from services.retriever.chunking import TokenChunker
from services.retriever.corpus import Corpus, DocumentUpload, SearchQuery
from services.retriever.embedder import Embedder
from services.retriever.rerank import load_reranker
from services.retriever.store import MilvusStore
from services.router.turns.context import ConversationContext
from tests.support.processes import ServiceProcess

TENANT = "acme"
DENSE, KEYWORD, HYBRID = pb.SEARCH_MODE_DENSE, pb.SEARCH_MODE_KEYWORD, pb.SEARCH_MODE_HYBRID
# (document id, title, markdown). The two cooperatives are twins: the Kovari one talks about
# "coffee farms" and "soil" the most, so plain search prefers it even for a Velasi question.
DOCUMENTS = (
    (
        "pump-log",
        "Pump station maintenance log",
        "# Pump station maintenance log\n\nThe east pump was serviced in March. The technician "
        "replaced gasket QZ-7781 and checked the pressure valves.\n\nThe west pump needs new "
        "bearings next quarter.\n",
    ),
    (
        "sourdough",
        "Baking notes",
        "# Baking notes\n\nSourdough loaves rise because a fermented starter of flour and water "
        "releases gas; bake them at 230 degrees for forty minutes.\n\nRye flour makes a denser crumb.\n",
    ),
    (
        "kovari",
        "Kovari Coffee Cooperative",
        "# Kovari Coffee Cooperative\n\nThe Kovari cooperative has 300 member families in the "
        "northern hills.\n\n## Soil\n\nThe coffee farms grow their coffee plants in soil: red "
        "volcanic soil, rich in iron, which the coffee farmers mulch every spring.\n",
    ),
    (
        "velasi",
        "Velasi Coffee Cooperative",
        "# Velasi Coffee Cooperative\n\nThe Velasi cooperative has 250 member families on the "
        "southern plateau.\n\n## Ground\n\nIts estates stand on pale limestone ground that drains "
        "fast, so the growers irrigate twice a week.\n",
    ),
    (
        "ostra",
        "Planet Ostra",
        "# Planet Ostra\n\nOstra is a cold gas giant with two moons and faint rings.\n",
    ),
)
TWIN_QUESTION = "What soil do the Velasi coffee farms grow in?"


def meta() -> tuple[tuple[str, str], ...]:
    return ((TENANT_KEY, TENANT),)


def ingest_all(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = retriever_pb2_grpc.RetrieverStub(channel)
        for document_id, title, text in DOCUMENTS:
            header = pb.DocumentHeader(document_id=document_id, title=title, mime_type="text/markdown")
            messages = iter([pb.IngestRequest(header=header), pb.IngestRequest(data=text.encode())])
            stub.Ingest(messages, metadata=meta(), timeout=60)


def start_retriever(folder: Path, *flags: str) -> ServiceProcess:
    service = ServiceProcess(
        "services.retriever", ["--milvus-uri", str(folder / "milvus.db"), "--metrics-port", "0", *flags]
    )
    service.start(timeout=300)
    return service


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    # The context reranker is not the default (measured weaker than hybrid), so name it.
    service = start_retriever(tmp_path_factory.mktemp("search-modes"), "--rerank-model", "context")
    try:
        ingest_all(service.address)
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def stub(retriever: ServiceProcess) -> Iterator[retriever_pb2_grpc.RetrieverStub]:
    with grpc.insecure_channel(retriever.address) as channel:
        yield retriever_pb2_grpc.RetrieverStub(channel)


def search(stub: retriever_pb2_grpc.RetrieverStub, query: str, **fields: object) -> pb.SearchResponse:
    response: pb.SearchResponse = stub.Search(
        pb.SearchRequest(query=query, **fields),  # type: ignore[arg-type]
        metadata=meta(),
        timeout=60,
    )
    return response


def ids(response: pb.SearchResponse) -> list[str]:
    return [c.document_id for c in response.chunks]


def test_a_rare_code_is_found_by_keyword_and_hybrid_search(stub: retriever_pb2_grpc.RetrieverStub) -> None:
    for mode in (KEYWORD, HYBRID):
        response = search(stub, "QZ-7781", top_k=3, mode=mode, rerank=False)
        assert response.mode == mode
        assert ids(response)[0] == "pump-log", (mode, ids(response))
        assert "QZ-7781" in response.chunks[0].text
    # Keyword search finds only chunks holding a query word: the code names one document.
    assert set(ids(search(stub, "QZ-7781", top_k=5, mode=KEYWORD, rerank=False))) == {"pump-log"}


def test_a_paraphrase_is_found_by_dense_and_hybrid_search(stub: retriever_pb2_grpc.RetrieverStub) -> None:
    question = "what makes naturally leavened bread go up in the oven"
    for mode in (DENSE, HYBRID):
        response = search(stub, question, top_k=3, mode=mode, rerank=False)
        assert ids(response)[0] == "sourdough", (mode, ids(response))
        # `score` is the cosine in every mode; `retrieval_score` is what the mode ranked by.
        assert 0.3 < response.chunks[0].score <= 1.0


def test_unspecified_mode_is_hybrid_and_reranked_when_a_reranker_is_loaded(
    stub: retriever_pb2_grpc.RetrieverStub,
) -> None:
    response = search(stub, "QZ-7781", top_k=2)
    assert response.mode == HYBRID and response.reranked and not response.degraded
    assert all(c.HasField("rerank_score") for c in response.chunks)
    plain = search(stub, "QZ-7781", top_k=2, rerank=False)
    assert not plain.reranked and not any(c.HasField("rerank_score") for c in plain.chunks)


def test_the_reranker_puts_the_twin_the_question_names_first(stub: retriever_pb2_grpc.RetrieverStub) -> None:
    plain = search(stub, TWIN_QUESTION, top_k=3, mode=HYBRID, rerank=False)
    reranked = search(stub, TWIN_QUESTION, top_k=3, mode=HYBRID, rerank=True, rerank_candidates=10)
    assert ids(plain)[0] == "kovari"  # the look-alike that talks about soil the most
    assert ids(reranked)[0] == "velasi"
    scores = [c.rerank_score for c in reranked.chunks]
    assert scores == sorted(scores, reverse=True)


async def test_rag_context_leaves_out_chunks_below_the_minimum_score(retriever: ServiceProcess) -> None:
    async with grpc.aio.insecure_channel(retriever.address) as channel:
        ctx = ConversationContext(None, retriever_pb2_grpc.RetrieverStub(channel), timeout_s=30)  # type: ignore[arg-type]

        async def retrieve(min_score: float | None) -> list[str]:
            rag = router_pb2.RagOptions(enabled=True, top_k=5)
            if min_score is not None:
                rag.min_score = min_score
            chunks = await ctx.retrieve(TENANT, "How cold is planet Ostra?", rag)
            return [c.document_id for c in chunks]

        everything = await retrieve(-1.0)
        strict = await retrieve(0.4)
        default = await retrieve(None)
    assert len(everything) == 5 and everything[0] == "ostra"
    assert strict == ["ostra"]  # the unrelated documents no longer pad the prompt
    assert default[0] == "ostra" and len(default) < len(everything)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"mode": 9}, "mode"),
        ({"rerank_candidates": 0}, "rerank_candidates"),
        ({"rerank_candidates": 101}, "rerank_candidates"),
    ],
)
def test_bad_search_options_are_invalid_arguments_naming_the_field(
    stub: retriever_pb2_grpc.RetrieverStub, fields: dict[str, object], field: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        search(stub, "pumps", **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith(f"{field}:")


def test_a_reranker_that_cannot_be_loaded_degrades_searches_instead_of_failing_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # In-process (a second service would double this file's time): the same loader and search path.
    embedder = Embedder()
    missing = str(tmp_path / "no-such-cross-encoder")
    with caplog.at_level(logging.WARNING, logger="llmmesh.retriever.rerank"):
        reranker, unavailable = load_reranker(missing, embedder)
    assert reranker is None and "could not be loaded" in caplog.text
    store = MilvusStore(str(tmp_path / "milvus.db"), embedder.model_name, embedder.dimension)
    try:
        corpus = Corpus(store, embedder, TokenChunker(embedder.token_spans), reranker_unavailable=unavailable)
        _, title, text = DOCUMENTS[0]
        corpus.ingest(TENANT, DocumentUpload("pump-log", text.encode(), "text/markdown", title=title))
        for rerank in (None, True):
            result = corpus.find(TENANT, SearchQuery("QZ-7781", top_k=2, rerank=rerank))
            assert [h.document_id for h in result.hits] == ["pump-log"]
            assert not result.reranked and "no-such-cross-encoder" in result.degraded
        assert not corpus.find(TENANT, SearchQuery("QZ-7781", rerank=False)).degraded
    finally:
        store.close()
