"""The retriever as a real process on Milvus Lite with the real embedding model.

One service for the module; the shipped corpus (tests/data/corpus, PDF and DOCX
generated from their specs) is ingested once through `llm-mesh ingest`, via a
router with tenant "acme"'s API key, as a user would. Tests that change documents
use their own ids or tenants, and call the retriever directly.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from services.common.metadata import TENANT_KEY
from services.gen.llmmesh.v1 import common_pb2, retriever_pb2_grpc
from services.gen.llmmesh.v1 import retriever_pb2 as pb
from tests.support.document_router import DocumentRouter, document_router
from tests.support.documents import build_corpus, content_stream_pdf, corpus_questions, text_pdf
from tests.support.processes import ROOT, ServiceProcess

TENANT = "acme"
MAX_DOCUMENT_BYTES = 200_000
#: Every real document here reads in milliseconds; a PDF of millions of text runs does not.
MAX_PARSE_SECONDS = 2


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    data = tmp_path_factory.mktemp("retriever")
    service = ServiceProcess(
        "services.retriever",
        [
            "--milvus-uri",
            str(data / "milvus.db"),
            "--max-document-bytes",
            str(MAX_DOCUMENT_BYTES),
            "--max-parse-seconds",
            str(MAX_PARSE_SECONDS),
            "--metrics-port",
            "0",
        ],
    )
    try:
        service.start()
        yield service
    finally:
        code = service.stop()
    # SIGTERM drains, closes Milvus Lite (its in-process server) and exits cleanly.
    assert code == 0, service.output()
    assert "MilvusLite server stopped" in service.output()


@pytest.fixture(scope="module")
def stub(retriever: ServiceProcess) -> Iterator[retriever_pb2_grpc.RetrieverStub]:
    with grpc.insecure_channel(retriever.address) as channel:
        yield retriever_pb2_grpc.RetrieverStub(channel)


@pytest.fixture(scope="module")
def router(retriever: ServiceProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocumentRouter]:
    """What `llm-mesh ingest` talks to: a router with an API key for TENANT."""
    with document_router(retriever.address, tmp_path_factory.mktemp("keys"), [TENANT]) as door:
        yield door


@pytest.fixture(scope="module")
def ingest_output(router: DocumentRouter, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = build_corpus(tmp_path_factory.mktemp("corpus"))
    (folder / "notes.rst").write_text("reStructuredText is not a supported type")
    result = router.ingest(str(folder), "--metadata", "collection=handbook", tenant=TENANT)
    # Every supported file went in; the .rst was skipped with its reason, so the exit is 1.
    assert result.returncode == 1, result.stdout + result.stderr
    return result.stdout


def meta(tenant: str = TENANT) -> tuple[tuple[str, str], ...]:
    return ((TENANT_KEY, tenant),)


def ingest(
    stub: retriever_pb2_grpc.RetrieverStub,
    document_id: str,
    data: bytes,
    mime_type: str = "text/plain",
    tenant: str = TENANT,
    piece: int = 64 * 1024,
    **metadata: str,
) -> pb.IngestSummary:
    header = pb.DocumentHeader(document_id=document_id, mime_type=mime_type, metadata=metadata)
    messages = [pb.IngestRequest(header=header)]
    messages += [pb.IngestRequest(data=data[i : i + piece]) for i in range(0, len(data), piece)]
    summary: pb.IngestSummary = stub.Ingest(iter(messages), metadata=meta(tenant), timeout=60)
    return summary


def search(
    stub: retriever_pb2_grpc.RetrieverStub, query: str, tenant: str = TENANT, **fields: object
) -> list[pb.RetrievedChunk]:
    response = stub.Search(pb.SearchRequest(query=query, **fields), metadata=meta(tenant), timeout=60)  # type: ignore[arg-type]
    return list(response.chunks)


def listed(stub: retriever_pb2_grpc.RetrieverStub, tenant: str = TENANT) -> dict[str, pb.DocumentInfo]:
    response = stub.ListDocuments(pb.ListDocumentsRequest(page_size=1000), metadata=meta(tenant), timeout=30)
    return {d.document_id: d for d in response.documents}


def rpc_error(call: object, *args: object, **kwargs: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, **kwargs)  # type: ignore[operator]
    return caught.value


def test_cli_ingests_every_format_and_reports_what_it_skipped(
    ingest_output: str, stub: retriever_pb2_grpc.RetrieverStub
) -> None:
    assert "ingested 7 documents (0 unchanged)" in ingest_output
    assert "notes.rst: unsupported type .rst" in ingest_output
    documents = listed(stub)
    assert {d.mime_type for d in documents.values()} == {
        "text/plain",
        "text/markdown",
        "text/html",
        "application/pdf",
        "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    }
    assert all(
        d.chunks >= 1 and d.version == 1 and d.metadata["collection"] == "handbook"
        for d in documents.values()
    )


def test_search_finds_the_answering_document_in_the_top_three(
    ingest_output: str, stub: retriever_pb2_grpc.RetrieverStub
) -> None:
    questions = corpus_questions()
    assert len(questions) >= 20
    misses = []
    for question, document in questions:
        ranked = [c.document_id for c in search(stub, question, top_k=3)]
        if document not in ranked:
            misses.append((question, document, ranked))
    recall = 1 - len(misses) / len(questions)
    assert recall >= 0.9, misses


def test_chunks_carry_page_heading_position_and_metadata(
    ingest_output: str, stub: retriever_pb2_grpc.RetrieverStub
) -> None:
    best = search(stub, "What is a pyroclastic flow?", top_k=1)[0]
    assert (best.document_id, best.page) == ("volcanoes.pdf", 2)
    best = search(stub, "How often should I feed my starter?", top_k=1)[0]
    assert (best.document_id, best.heading) == ("sourdough.md", "Keeping a starter")
    assert best.position >= 1 and best.document_version == 1
    assert best.metadata["collection"] == "handbook"
    assert "feed it once or twice a day" in best.text
    # A metadata filter nothing matches leaves nothing; min_score above every hit leaves nothing.
    assert search(stub, "starter", metadata_filter={"collection": "other"}) == []
    assert search(stub, "starter", min_score=0.99) == []


def test_reingesting_identical_content_changes_nothing(
    ingest_output: str, router: DocumentRouter, stub: retriever_pb2_grpc.RetrieverStub
) -> None:
    before = listed(stub)
    again = router.ingest(
        str(ROOT / "tests/data/corpus/lighthouses.txt"), str(ROOT / "tests/data/corpus/sourdough.md"),
        "--metadata", "collection=handbook", tenant=TENANT, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert "ingested 0 documents (2 unchanged)" in again.stdout
    after = listed(stub)
    assert {k: (d.chunks, d.version, d.updated_at_ms) for k, d in after.items()} == {
        k: (d.chunks, d.version, d.updated_at_ms) for k, d in before.items()
    }
    hits = search(stub, "Who invented the Fresnel lens?", top_k=20)
    assert {(c.document_id, c.document_version) for c in hits if c.document_id == "lighthouses.txt"} == {
        ("lighthouses.txt", 1)
    }


def test_changed_content_replaces_old_chunks_and_delete_removes_them(
    stub: retriever_pb2_grpc.RetrieverStub,
) -> None:
    old = b"The harbour ferry leaves at 7 am and returns at noon. Tickets are sold on board."
    new = b"The harbour ferry now leaves at 9 am. Tickets must be bought online in advance."
    first = ingest(stub, "ferry.txt", old)
    assert (first.version, first.unchanged) == (1, False)
    assert ingest(stub, "ferry.txt", old).unchanged

    second = ingest(stub, "ferry.txt", new)
    assert (second.version, second.unchanged) == (2, False)
    hits = [
        c
        for c in search(stub, "When does the harbour ferry leave?", top_k=20)
        if c.document_id == "ferry.txt"
    ]
    assert len(hits) == second.chunks
    assert {(c.document_version, c.text) for c in hits} == {(2, new.decode())}

    deleted = stub.DeleteDocument(
        pb.DeleteDocumentRequest(document_id="ferry.txt"), metadata=meta(), timeout=30
    )
    assert deleted.chunks_deleted == second.chunks
    assert all(c.document_id != "ferry.txt" for c in search(stub, "harbour ferry tickets", top_k=20))
    assert "ferry.txt" not in listed(stub)
    error = rpc_error(stub.DeleteDocument, pb.DeleteDocumentRequest(document_id="ferry.txt"), metadata=meta())
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_tenants_never_see_each_others_documents(
    ingest_output: str, stub: retriever_pb2_grpc.RetrieverStub
) -> None:
    assert search(stub, "How do bees find flowers?", tenant="globex") == []
    assert listed(stub, "globex") == {}
    # The same document id under another tenant is a separate document.
    other = ingest(
        stub, "honeybees.html", b"<p>Globex keeps no bees, only wasps.</p>", "text/html", tenant="globex"
    )
    assert other.version == 1
    assert {c.document_id for c in search(stub, "bees", tenant="globex", top_k=10)} == {"honeybees.html"}
    assert all("wasps" not in c.text for c in search(stub, "wasps", top_k=10))
    error = rpc_error(
        stub.DeleteDocument, pb.DeleteDocumentRequest(document_id="lighthouses.txt"), metadata=meta("globex")
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "lighthouses.txt" in listed(stub)


def test_calls_without_a_tenant_are_refused(stub: retriever_pb2_grpc.RetrieverStub) -> None:
    error = rpc_error(stub.Search, pb.SearchRequest(query="anything"), timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert TENANT_KEY in (error.details() or "")


def test_an_ingest_stream_must_start_with_its_header(stub: retriever_pb2_grpc.RetrieverStub) -> None:
    for messages in ([pb.IngestRequest(data=b"orphan bytes")], []):
        error = rpc_error(stub.Ingest, iter(messages), metadata=meta(), timeout=10)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (error.details() or "").startswith("header:")


BROKEN_PDF = text_pdf([["A page that will be cut short."]])[:150]


@pytest.mark.parametrize(
    ("data", "mime_type", "field"),
    [
        (BROKEN_PDF, "application/pdf", "data: not a readable PDF"),
        (b"\x89PNG\r\n\x1a\n", "image/png", "header.mime_type: unsupported type 'image/png'"),
        (b"", "text/plain", "data: document is empty"),
        (b"\n \n", "text/markdown", "data: document has no extractable text"),
        (b"x" * (MAX_DOCUMENT_BYTES + 1), "text/plain", "data: document exceeds the 200000-byte limit"),
    ],
    ids=["corrupt-pdf", "unknown-type", "empty", "blank", "oversize"],
)
def test_bad_documents_are_refused_and_leave_the_stored_version_alone(
    stub: retriever_pb2_grpc.RetrieverStub, data: bytes, mime_type: str, field: str
) -> None:
    good = ingest(
        stub, "manual.txt", b"The pump must be primed with water before first use.", tenant="bad-input"
    )
    error = rpc_error(ingest, stub, "manual.txt", data, mime_type, tenant="bad-input")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (error.details() or "")
    stored = listed(stub, "bad-input")["manual.txt"]
    assert (stored.version, stored.chunks, stored.content_hash) == (
        good.version,
        good.chunks,
        good.content_hash,
    )
    error = rpc_error(ingest, stub, "never-stored.txt", data, mime_type, tenant="bad-input")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "never-stored.txt" not in listed(stub, "bad-input")
    assert [c.document_id for c in search(stub, "prime the pump", tenant="bad-input", top_k=10)] == [
        "manual.txt"
    ]


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"query": "pumps", "top_k": 0}, "top_k"),
        ({"query": "pumps", "top_k": 101}, "top_k"),
        ({"query": "pumps", "top_k": 4_000_000_000}, "top_k"),
        ({"query": "pumps", "min_score": 1.5}, "min_score"),
        ({"query": "pumps", "min_score": -1.01}, "min_score"),
        ({"query": "pumps", "min_score": float("nan")}, "min_score"),
        ({"query": "   "}, "query"),
        ({"query": "pumps", "metadata_filter": {"bad key!": "x"}}, "metadata_filter"),
    ],
)
def test_bad_searches_are_invalid_arguments_naming_the_field(
    stub: retriever_pb2_grpc.RetrieverStub, request_fields: dict[str, object], field: str
) -> None:
    error = rpc_error(stub.Search, pb.SearchRequest(**request_fields), metadata=meta(), timeout=10)  # type: ignore[arg-type]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith(f"{field}:")


def test_embed_cuts_an_over_long_text_unless_told_not_to(stub: retriever_pb2_grpc.RetrieverStub) -> None:
    long_text = " ".join(f"word{i}" for i in range(400))  # over MiniLM's 256-token input
    head = " ".join(long_text.split()[:60])
    cut = stub.Embed(pb.EmbedRequest(texts=[long_text, "hello world"]), timeout=60)
    # The model's input is 256 tokens, its [CLS] and [SEP] included; "hello world" is 2 + 2.
    assert cut.tokens == 256 + 4
    # Cut, its vector is that of its beginning: a later change to its end changes nothing.
    changed_end = stub.Embed(pb.EmbedRequest(texts=[long_text + " zebra"]), timeout=60)
    assert list(changed_end.embeddings[0].values) == list(cut.embeddings[0].values)
    assert list(cut.embeddings[0].values) != list(
        stub.Embed(pb.EmbedRequest(texts=[head])).embeddings[0].values
    )
    error = rpc_error(stub.Embed, pb.EmbedRequest(texts=["fine", long_text], truncate=False), timeout=60)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith("texts[1]: ") and "256-token input" in (error.details() or "")
    fits = stub.Embed(pb.EmbedRequest(texts=[head], truncate=False), timeout=60)
    assert len(fits.embeddings) == 1


def test_diversify_keeps_the_best_chunk_first_and_no_more_than_top_k(
    ingest_output: str, stub: retriever_pb2_grpc.RetrieverStub
) -> None:
    plain = search(stub, "How do I bake sourdough bread?", top_k=4)
    diverse = search(stub, "How do I bake sourdough bread?", top_k=4, diversify=True)
    assert len(diverse) == 4
    assert diverse[0].chunk_id == plain[0].chunk_id
    assert len({c.chunk_id for c in diverse}) == 4


def test_semantic_cache_hits_paraphrases_and_misses_unrelated_prompts(
    ingest_output: str, stub: retriever_pb2_grpc.RetrieverStub
) -> None:
    stored = stub.CacheStore(
        pb.CacheStoreRequest(
            prompt="How do I keep my sourdough starter alive?",
            model="smollm2-135m",
            params_fingerprint="temp=0",
            answer="Feed it flour and water once or twice a day.",
            cited=[pb.CitedDocument(document_id="sourdough.md", version=1)],
        ),
        metadata=meta(),
        timeout=30,
    )
    lookup = pb.CacheLookupRequest(model="smollm2-135m", params_fingerprint="temp=0")

    lookup.prompt = "What's the way to keep a sourdough starter alive?"
    hit = stub.CacheLookup(lookup, metadata=meta(), timeout=30)
    assert hit.hit and hit.entry_id == stored.entry_id and hit.similarity >= 0.92
    assert hit.answer == "Feed it flour and water once or twice a day."
    assert hit.cached_prompt == "How do I keep my sourdough starter alive?"

    for prompt in ("What is the capital of France?", "How do I keep my sourdough starter healthy?"):
        lookup.prompt = prompt
        assert not stub.CacheLookup(lookup, metadata=meta(), timeout=30).hit, prompt
    lookup.prompt = "How do I keep my sourdough starter alive?"
    assert not stub.CacheLookup(lookup, metadata=meta("globex"), timeout=30).hit
    lookup.threshold = 1.5
    error = rpc_error(stub.CacheLookup, lookup, metadata=meta(), timeout=30)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and (error.details() or "").startswith(
        "threshold:"
    )


def test_semantic_cache_entries_expire_and_die_with_their_documents(
    stub: retriever_pb2_grpc.RetrieverStub,
) -> None:
    tenant = "cache-life"
    ingest(stub, "hours.txt", b"The library opens at 8 am on weekdays.", tenant=tenant)
    for prompt, ttl in (("Is the library open on weekdays?", 600), ("When does the library open?", 3)):
        stored_at = time.monotonic()
        stub.CacheStore(
            pb.CacheStoreRequest(
                prompt=prompt,
                model="m",
                answer="8 am",
                ttl_seconds=ttl,
                cited=[pb.CitedDocument(document_id="hours.txt")],
            ),
            metadata=meta(tenant),
            timeout=30,
        )

    def hit(prompt: str) -> bool:
        request = pb.CacheLookupRequest(prompt=prompt, model="m")
        return bool(stub.CacheLookup(request, metadata=meta(tenant), timeout=30).hit)

    assert hit("When does the library open?") and hit("Is the library open on weekdays?")
    time.sleep(max(0.0, stored_at + 3.2 - time.monotonic()))
    assert not hit("When does the library open?")  # past its 3 s TTL
    assert hit("Is the library open on weekdays?")
    ingest(stub, "hours.txt", b"The library opens at 9 am on weekdays.", tenant=tenant)
    assert not hit("Is the library open on weekdays?")  # it cited version 1


def test_a_semantic_hit_returns_the_usage_and_finish_reason_stored_with_the_answer(
    stub: retriever_pb2_grpc.RetrieverStub,
) -> None:
    tenant = "cache-usage"
    usage = common_pb2.Usage(prompt_tokens=58, completion_tokens=21, cached_prompt_tokens=32)
    stored = stub.CacheStore(
        pb.CacheStoreRequest(
            prompt="How long should I boil an egg for a soft yolk?",
            model="m",
            answer="About six minutes.",
            usage=usage,
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
        ),
        metadata=meta(tenant),
        timeout=30,
    )
    stub.CacheStore(
        pb.CacheStoreRequest(prompt="Which planet is closest to the sun?", model="m", answer="Mercury."),
        metadata=meta(tenant),
        timeout=30,
    )

    def lookup(prompt: str) -> pb.CacheLookupResponse:
        request = pb.CacheLookupRequest(prompt=prompt, model="m")
        response: pb.CacheLookupResponse = stub.CacheLookup(request, metadata=meta(tenant), timeout=30)
        assert response.hit, prompt
        return response

    hit = lookup("How long do I boil an egg for a soft yolk?")
    assert hit.entry_id == stored.entry_id
    assert hit.usage == usage and hit.finish_reason == common_pb2.FINISH_REASON_LENGTH
    # Stored without usage: zero and UNSPECIFIED, as an entry from before usage was kept.
    plain = lookup("Which planet is closest to the sun?")
    assert plain.usage == common_pb2.Usage() and plain.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED


def test_metrics_count_chunks_searches_and_cache_lookups(
    ingest_output: str, retriever: ServiceProcess, stub: retriever_pb2_grpc.RetrieverStub
) -> None:
    search(stub, "lighthouse lens")
    stub.CacheLookup(
        pb.CacheLookupRequest(prompt="nothing cached here", model="m"), metadata=meta(), timeout=30
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{retriever.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmmesh_") and " " in line
    }
    assert values["llmmesh_retriever_chunks_total"] >= 7
    assert values["llmmesh_retriever_search_seconds_count"] >= 1
    assert values["llmmesh_retriever_ingest_seconds_count"] >= 7
    assert values['llmmesh_semantic_cache_lookups_total{result="miss"}'] >= 1
    # The query and the prompt above each went through the embed coalescer (one text per call
    # when nothing else was waiting).
    assert values["llmmesh_retriever_embed_call_texts_count"] >= 2
    assert values['llmmesh_retriever_embed_call_texts_bucket{le="1.0"}'] >= 2


def test_a_legacy_encoded_file_is_ingested_by_its_declared_charset_and_refused_without_it(
    router: DocumentRouter, stub: retriever_pb2_grpc.RetrieverStub, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.mktemp("legacy")
    text = "Pâtisserie\n\nA crème brûlée needs its custard set and the sugar crust torched just before serving.\n"
    (folder / "dessert.txt").write_bytes(text.encode("windows-1252"))

    undeclared = router.ingest(str(folder), "--id-prefix", "undeclared/", tenant=TENANT)
    declared = router.ingest(
        str(folder), "--id-prefix", "cp1252/", "--charset", "windows-1252", tenant=TENANT
    )

    # Without the charset nothing is guessed: the file is refused, saying how to declare it.
    assert undeclared.returncode == 1
    assert "not valid UTF-8" in undeclared.stdout and "charset=" in undeclared.stdout
    assert "undeclared/dessert.txt" not in listed(stub)
    assert declared.returncode == 0, declared.stdout + declared.stderr
    document = listed(stub)["cp1252/dessert.txt"]
    assert document.mime_type == "text/plain; charset=windows-1252"
    (best,) = search(stub, "How is a crème brûlée finished?", top_k=1)
    assert best.document_id == "cp1252/dessert.txt" and best.heading == "Pâtisserie"
    assert "crème brûlée" in best.text
    # Gone again: the module's other tests count this tenant's documents and their types.
    stub.DeleteDocument(
        pb.DeleteDocumentRequest(document_id="cp1252/dessert.txt"), metadata=meta(), timeout=30
    )


def test_csv_and_json_documents_are_searchable_with_each_value_beside_its_name(
    stub: retriever_pb2_grpc.RetrieverStub,
) -> None:
    tenant = "tabular"
    # A spreadsheet export (semicolons, as European Excel writes it) and an API dump.
    rows = "office;city;opening hours;phone\nNorth;Tromsø;08:00–16:00;+47 111\nSouth;Seville;09:00–14:00;+34 222\n"
    ingest(stub, "offices.csv", rows.encode(), "text/csv", tenant=tenant)
    api = {
        "product": "Kettle K2",
        "specs": {"power_watts": 2200, "capacity_litres": 1.7},
        "colours": ["red", "grey"],
    }
    ingest(stub, "kettle.json", json.dumps(api).encode(), "application/json", tenant=tenant)
    best = search(stub, "When does the Seville office open?", tenant=tenant, top_k=1)[0]
    assert best.document_id == "offices.csv"
    assert "office: South; city: Seville; opening hours: 09:00–14:00; phone: +34 222" in best.text
    ranked = search(stub, "How many watts is the kettle?", tenant=tenant, top_k=3)
    specs = [c for c in ranked if c.document_id == "kettle.json" and c.heading == "specs"]
    assert specs and "specs.power_watts: 2200" in specs[0].text, [(c.heading, c.text) for c in ranked]
    # Bytes that are not the JSON they claim to be are refused, naming the field.
    error = rpc_error(ingest, stub, "broken.json", b'{"a": ', "application/json", tenant=tenant)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "data: not valid JSON" in error.details()
    assert set(listed(stub, tenant)) == {"offices.csv", "kettle.json"}


def test_a_small_pdf_of_millions_of_text_runs_is_refused_at_the_deadline_and_the_tenant_keeps_its_documents(
    stub: retriever_pb2_grpc.RetrieverStub,
) -> None:
    tenant = "pdf-bomb"
    ingest(stub, "kept.pdf", text_pdf([["Basalt cools from lava."]]), "application/pdf", tenant=tenant)
    # 12 pages of 200,000 runs each, Flate-compressed to a few kilobytes: minutes of pypdf's
    # time without a bound.
    runs = b"BT /F1 11 Tf 50 760 Td " + b"(a) Tj " * 200_000 + b"ET"
    bomb = content_stream_pdf(runs, pages=12, compress=True)
    assert len(bomb) < MAX_DOCUMENT_BYTES
    error = rpc_error(ingest, stub, "bomb.pdf", bomb, "application/pdf", tenant=tenant)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error.details() or ""
    assert details.startswith(f"data: PDF took longer than {MAX_PARSE_SECONDS} s to read"), details
    read = int(details.split("(", 1)[1].split(" of ", 1)[0])
    assert read < 12 and "of 12 pages read" in details and "--max-parse-seconds" in details
    # Nothing of it was stored, and the tenant's other document is still found.
    assert set(listed(stub, tenant)) == {"kept.pdf"}
    assert search(stub, "What does lava become?", tenant=tenant, top_k=1)[0].document_id == "kept.pdf"
