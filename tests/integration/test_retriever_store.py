"""Corpus and semantic cache on a real Milvus Lite store, in-process.

Retrieval quality is not the subject here, so a bag-of-words fake stands in for
the embedding model and a whitespace fake for its tokenizer: that keeps these
tests fast and lets them reach the states between the steps of an ingest.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pymilvus import DataType, MilvusClient

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.grpc_status import status_for
from services.retriever.chunking import ChunkingPolicy, TokenChunker
from services.retriever.corpus import Corpus, DocumentUpload, SearchQuery
from services.retriever.embedder import Vectors, normalize_rows
from services.retriever.filters import digest
from services.retriever.records import AnswerUsage, ChunkHit, ChunkRow, DocumentRecord
from services.retriever.schema import DIMENSION_PROPERTY, MODEL_PROPERTY, CollectionNames
from services.retriever.search_modes import SearchMode
from services.retriever.semantic_cache import CacheScope, SemanticCache
from services.retriever.store import MilvusStore

DIM = 64


class BagOfWordsFakeEmbedder:
    """Hashes words into a fixed-size count vector: similar wording, similar vector."""

    model_name = "fake-bag-of-words"
    dimension = DIM

    def embed(self, texts: Sequence[str]) -> Vectors:
        rows = np.zeros((len(texts), DIM), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                rows[i, int(hashlib.md5(word.encode()).hexdigest(), 16) % DIM] += 1.0
        rows[:, 0] += 1e-3  # never a zero vector
        return normalize_rows(rows)


def whitespace_token_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"\S+", text)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class ObservedStore(MilvusStore):
    """A real store that runs a callback after every write, to look at the corpus between ingest steps."""

    observe: object = None

    def _after_write(self, step: str) -> None:
        if callable(self.observe):
            self.observe(step)

    def write_chunks(self, record: DocumentRecord, chunks: Sequence[ChunkRow], vectors: Vectors) -> None:
        super().write_chunks(record, chunks, vectors)
        self._after_write("write_chunks")

    def put_document(self, record: DocumentRecord) -> None:
        super().put_document(record)
        self._after_write("put_document")

    def delete_chunks(self, tenant: str, document_id: str, keep_version: int | None = None) -> int:
        deleted = super().delete_chunks(tenant, document_id, keep_version)
        self._after_write("delete_chunks")
        return deleted


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObservedStore]:
    path = tmp_path_factory.mktemp("milvus") / "milvus.db"
    store = ObservedStore(str(path), BagOfWordsFakeEmbedder.model_name, DIM)
    yield store
    store.close()


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture()
def corpus(store: ObservedStore, clock: FakeClock) -> Corpus:
    chunker = TokenChunker(whitespace_token_spans, ChunkingPolicy(max_tokens=8, overlap_tokens=2))
    return Corpus(store, BagOfWordsFakeEmbedder(), chunker, clock=clock)


@pytest.fixture()
def cache(store: ObservedStore, clock: FakeClock) -> SemanticCache:
    return SemanticCache(store, BagOfWordsFakeEmbedder(), threshold=0.9, ttl_seconds=600, clock=clock)


def upload(document_id: str, text: str, **metadata: str) -> DocumentUpload:
    return DocumentUpload(document_id, text.encode(), "text/plain", metadata=metadata)


def versions_by_document(hits: Sequence[ChunkHit]) -> dict[str, set[int]]:
    seen: dict[str, set[int]] = {}
    for hit in hits:
        seen.setdefault(hit.document_id, set()).add(hit.document_version)
    return seen


def test_replacing_a_document_is_never_seen_half_done(store: ObservedStore, corpus: Corpus) -> None:
    tenant = "atomic"
    old = "river delta silt " * 12
    new = "river delta sand " * 9
    first = corpus.ingest(tenant, upload("delta", old))
    query = SearchQuery("river delta", top_k=50)
    observations: list[tuple[str, dict[str, set[int]], int]] = []

    def look(step: str) -> None:
        hits = corpus.search(tenant, query)
        observations.append((step, versions_by_document(hits), len(hits)))

    store.observe = look
    try:
        second = corpus.ingest(tenant, upload("delta", new))
    finally:
        store.observe = None

    assert (first.version, second.version) == (1, 2)
    steps = [step for step, _, _ in observations]
    assert steps == ["delete_chunks", "write_chunks", "put_document", "delete_chunks"]
    for step, seen, count in observations:
        # Every search between the steps sees exactly one whole version.
        assert seen["delta"] in ({1}, {2}), step
        assert count == (first.chunks if seen["delta"] == {1} else second.chunks), step
    assert [seen["delta"] for _, seen, _ in observations] == [{1}, {1}, {2}, {2}]
    assert store.count_chunks(tenant, "delta") == second.chunks


def test_leftovers_of_an_interrupted_ingest_stay_invisible_and_are_cleaned_up(
    store: ObservedStore, corpus: Corpus
) -> None:
    tenant = "crash"
    first = corpus.ingest(tenant, upload("notes", "glacier ice moraine " * 6))
    record = store.get_document(tenant, "notes")
    assert record is not None
    # A crash after writing version 2's chunks but before the flip leaves these behind.
    orphan = DocumentRecord(**{**record.__dict__, "version": 2, "chunks": 20})
    rows = [ChunkRow(i, f"glacier orphan {i}", "", 0) for i in range(20)]
    store.write_chunks(orphan, rows, BagOfWordsFakeEmbedder().embed([r.text for r in rows]))

    hits = corpus.search(tenant, SearchQuery("glacier", top_k=50))
    assert versions_by_document(hits) == {"notes": {1}}
    assert len(hits) == first.chunks

    second = corpus.ingest(tenant, upload("notes", "glacier ice crevasse " * 3))
    assert second.version == 2
    assert store.count_chunks(tenant, "notes") == second.chunks < 20
    assert all("orphan" not in h.text for h in corpus.search(tenant, SearchQuery("glacier orphan", top_k=50)))


def test_metadata_filter_matches_values_with_quotes_and_backslashes(corpus: Corpus) -> None:
    tenant = "filters"
    tricky = 'R&D "core" \\ ops'
    corpus.ingest(tenant, upload("a", "quarterly plan for the team", team=tricky))
    corpus.ingest(tenant, upload("b", "quarterly plan for the team", team="sales"))
    hits = corpus.search(tenant, SearchQuery("quarterly plan", metadata_filter={"team": tricky}))
    assert {h.document_id for h in hits} == {"a"}
    assert hits[0].metadata == {"team": tricky}
    # Control characters too (a property test found "\x1f" answered INTERNAL: Milvus has no \u escapes).
    for value in ("\x1f", "line\nbreak\x00"):
        corpus.ingest(tenant, upload("c", "quarterly plan for the team", team=value))
        hits = corpus.search(tenant, SearchQuery("quarterly plan", metadata_filter={"team": value}))
        assert [h.document_id for h in hits] == ["c"]
    with pytest.raises(InvalidArgument, match="metadata_filter"):
        SearchQuery("quarterly plan", metadata_filter={'team"] or 1 == 1 or metadata["x': "y"})
    # A key ending in a newline passed the key check ("$" matches before a final "\n"), broke
    # Milvus's filter parser and answered INTERNAL, which opened the router's retriever breaker
    # for every tenant; at ingest it was stored.
    with pytest.raises(InvalidArgument, match="metadata_filter"):
        SearchQuery("quarterly plan", metadata_filter={"team\n": "y"})
    with pytest.raises(InvalidArgument) as stored:
        corpus.ingest(tenant, upload("d", "quarterly plan for the team", **{"team\n": "sales"}))
    assert stored.value.field == "header.metadata"


# Only "xj9q7" is a content word (the rest are stop words), so BM25 ranks by that code alone
# while the bag-of-words cosine also counts the stop words: the two orders disagree.
CODE_QUESTION = "what does XJ9Q7 do"


def ingest_code_fixture(corpus: Corpus, tenant: str) -> None:
    """More keyword matches of low cosine than one search window (20) holds, and two chunks of
    high cosine: one the keyword ranks last, one it does not match at all."""
    for i in range(24):
        corpus.ingest(tenant, upload(f"noise-{i:02d}", f"XJ9Q7 XJ9Q7 tomato compost mulch bed {i}"))
    corpus.ingest(
        tenant, upload("what-kw", "what does XJ9Q7 do and what does that do in a long relay manual")
    )
    corpus.ingest(tenant, upload("what-only", "what does it do and what does that do"))


@pytest.mark.parametrize("mode", list(SearchMode), ids=lambda m: m.name.lower())
def test_min_score_keeps_the_best_top_k_of_the_chunks_that_pass_it(corpus: Corpus, mode: SearchMode) -> None:
    # min_score was applied after the cut to top_k: in keyword and hybrid order a chunk that
    # passes it can sit below top_k that do not, and the search answered fewer or none.
    tenant = "min-score-order"
    ingest_code_fixture(corpus, tenant)
    ranked = corpus.search(tenant, SearchQuery(CODE_QUESTION, top_k=100, mode=mode.value))
    minimum = 0.5
    passing = [h.chunk_id for h in ranked if h.score >= minimum]
    assert passing, "the fixture must have chunks above the minimum"
    for top_k in (1, 2):
        hits = corpus.search(
            tenant, SearchQuery(CODE_QUESTION, top_k=top_k, mode=mode.value, min_score=minimum)
        )
        assert [h.chunk_id for h in hits] == passing[:top_k]
        assert all(h.score >= minimum for h in hits)
    if mode is not SearchMode.DENSE:  # the case that was lost: the first passing chunk ranks below 1
        assert [h.chunk_id for h in ranked].index(passing[0]) >= 1


@pytest.mark.parametrize("mode", list(SearchMode), ids=lambda m: m.name.lower())
def test_diversify_keeps_the_modes_best_chunk_first(corpus: Corpus, mode: SearchMode) -> None:
    # MMR ranked by cosine in every mode, so in hybrid the chunk the fusion put first could lose
    # its place to one the dense list preferred.
    tenant = "diversify-first"
    ingest_code_fixture(corpus, tenant)
    for top_k in (1, 3):
        plain = corpus.search(tenant, SearchQuery(CODE_QUESTION, top_k=top_k, mode=mode.value))
        diverse = corpus.search(
            tenant, SearchQuery(CODE_QUESTION, top_k=top_k, mode=mode.value, diversify=True)
        )
        assert diverse[0].chunk_id == plain[0].chunk_id
        assert len(diverse) == len(plain)


def test_diversify_replaces_near_duplicates_with_other_relevant_chunks(corpus: Corpus) -> None:
    # MMR was given only the top_k, so it could reorder three copies of one text but never let
    # the next different chunk in.
    tenant = "diversify-duplicates"
    for document_id in ("copy-1", "copy-2", "copy-3", "copy-4"):
        corpus.ingest(tenant, upload(document_id, "pump valve seal check"))
    corpus.ingest(tenant, upload("other", "pump valve seal torque spec"))
    for mode in SearchMode:
        query = SearchQuery("pump valve seal", top_k=3, mode=mode.value)
        plain = corpus.search(tenant, query)
        assert len({h.text for h in plain}) == 1, "the fixture's copies must fill the plain top 3"
        diverse = corpus.search(
            tenant, SearchQuery("pump valve seal", top_k=3, mode=mode.value, diversify=True)
        )
        assert len(diverse) == 3
        assert len({h.text for h in diverse}) == 2
        assert diverse[0].chunk_id == plain[0].chunk_id


def keyword_hits(corpus: Corpus, tenant: str, query: str) -> list[str]:
    hits = corpus.search(tenant, SearchQuery(query, mode=SearchMode.KEYWORD.value, top_k=10))
    return [h.document_id for h in hits]


def test_keyword_search_finds_chinese_and_japanese_words_inside_unspaced_text(corpus: Corpus) -> None:
    # Milvus Lite's analyzer splits on \w+: a whole run of Chinese up to its punctuation was one
    # "word", so no query but that exact run found it.
    tenant = "cjk"
    corpus.ingest(tenant, upload("zh-retriever", "检索服务把文档切分成块，然后写入向量数据库。"))
    corpus.ingest(tenant, upload("zh-install", "请先安装依赖，再启动路由服务。"))
    corpus.ingest(tenant, upload("ja", "東京は日本の首都です。カタカナの説明もあります。"))
    corpus.ingest(tenant, upload("en", "The router forwards prompts to replicas."))
    assert keyword_hits(corpus, tenant, "数据库") == ["zh-retriever"]
    assert keyword_hits(corpus, tenant, "如何安装依赖") == ["zh-install"]
    assert keyword_hits(corpus, tenant, "首都") == ["ja"]
    assert keyword_hits(corpus, tenant, "カタカナ") == ["ja"]
    # The stored text is the document's own, not the index's segmented form.
    hit = corpus.search(tenant, SearchQuery("数据库", mode=SearchMode.KEYWORD.value, top_k=1))[0]
    assert hit.text == "检索服务把文档切分成块，然后写入向量数据库。"


def test_keyword_search_finds_words_inside_thai_lao_khmer_and_myanmar_runs(corpus: Corpus) -> None:
    # Written without spaces between words: a run up to the next space was one "word" to the
    # analyzer, found only by a query of that exact run.
    tenant = "southeast-asian"
    corpus.ingest(tenant, upload("th-db", "บริการค้นหาแบ่งเอกสารเป็นชิ้นแล้วเขียนลงฐานข้อมูลเวกเตอร์"))
    corpus.ingest(tenant, upload("th-install", "กรุณาติดตั้งซอฟต์แวร์ก่อนเริ่มบริการ"))
    corpus.ingest(tenant, upload("km", "ទីក្រុងភ្នំពេញជារាជធានីនៃប្រទេសកម្ពុជា"))
    corpus.ingest(tenant, upload("lo", "ວຽງຈັນແມ່ນນະຄອນຫຼວງຂອງລາວ"))
    corpus.ingest(tenant, upload("my", "ရန်ကုန်မြို့သည်မြန်မာနိုင်ငံ၏အကြီးဆုံးမြို့ဖြစ်သည်"))
    corpus.ingest(tenant, upload("en", "The router forwards prompts to replicas."))
    assert keyword_hits(corpus, tenant, "ฐานข้อมูล")[0] == "th-db"  # "database"
    assert keyword_hits(corpus, tenant, "ติดตั้ง")[0] == "th-install"  # "install"
    assert keyword_hits(corpus, tenant, "រាជធានី") == ["km"]  # "capital"
    assert keyword_hits(corpus, tenant, "ນະຄອນຫຼວງ") == ["lo"]  # "capital"
    assert keyword_hits(corpus, tenant, "မြန်မာ") == ["my"]  # "Myanmar"
    hit = corpus.search(tenant, SearchQuery("ฐานข้อมูล", mode=SearchMode.KEYWORD.value, top_k=1))[0]
    assert hit.text == "บริการค้นหาแบ่งเอกสารเป็นชิ้นแล้วเขียนลงฐานข้อมูลเวกเตอร์"


def test_keyword_search_matches_a_word_however_its_characters_are_encoded(corpus: Corpus) -> None:
    tenant = "unicode-forms"
    corpus.ingest(tenant, upload("nfd", "The cafe\u0301 sells re\u0301sume\u0301 pastries."))  # decomposed
    corpus.ingest(tenant, upload("zwsp", "Rotate the pass\u200bword every quarter."))  # zero-width space
    corpus.ingest(tenant, upload("shy", "See the config\u00aduration manual."))  # soft hyphen
    corpus.ingest(tenant, upload("ligature", "The \ufb01rewall blocks port 25."))  # a PDF's "fi"
    assert keyword_hits(corpus, tenant, "caf\u00e9") == ["nfd"]  # typed precomposed
    assert keyword_hits(corpus, tenant, "r\u00e9sum\u00e9") == ["nfd"]
    assert keyword_hits(corpus, tenant, "password") == ["zwsp"]
    assert keyword_hits(corpus, tenant, "configuration") == ["shy"]
    assert keyword_hits(corpus, tenant, "firewall") == ["ligature"]
    # And the other way round: a decomposed query finds precomposed text.
    corpus.ingest(tenant, upload("nfc", "Na\u00efve Bayes spam filters."))
    assert keyword_hits(corpus, tenant, "nai\u0308ve") == ["nfc"]


@pytest.mark.parametrize("query_window", [16_384, 4], ids=["one-query", "window-smaller-than-tenant"])
def test_documents_are_listed_in_pages_in_id_order(
    corpus: Corpus, monkeypatch: pytest.MonkeyPatch, query_window: int
) -> None:
    # A tiny query window makes listing narrow its id range, as it must past 16,384 documents.
    monkeypatch.setattr("services.retriever.store.MAX_QUERY_WINDOW", query_window)
    tenant = f"lister-{query_window}"
    ids = [f"doc-{i:02d}" for i in (5, 1, 7, 3, 2, 6, 4, 9, 8)]
    for document_id in ids:
        corpus.ingest(tenant, upload(document_id, f"page listing test {document_id}"))
    listed: list[str] = []
    token = ""
    pages = 0
    while True:
        records, token = corpus.list(tenant, 2, token)
        listed += [r.document_id for r in records]
        pages += 1
        if not token:
            break
    assert (listed, pages) == (sorted(ids), 5)
    with pytest.raises(InvalidArgument, match="page_token"):
        corpus.list(tenant, 3, "%%%not-a-token")
    with pytest.raises(InvalidArgument, match="page_size"):
        corpus.list(tenant, 5000, "")


def test_a_store_built_by_another_model_refuses_vector_calls(tmp_path: Path) -> None:
    path = str(tmp_path / "milvus.db")
    MilvusStore(path, "model-a", DIM).close()
    for model, dimension in (("model-b", DIM), ("model-a", DIM // 2)):
        other = MilvusStore(path, model, dimension)
        try:
            assert other.mismatch is not None and "model-a" in other.mismatch
            with pytest.raises(FailedPrecondition, match="embedding model 'model-a'") as caught:
                other.search_chunks("t", SearchMode.DENSE, "q", np.ones(dimension, dtype=np.float32), 3, {})
            assert status_for(caught.value).name == "FAILED_PRECONDITION"
        finally:
            other.close()
    same = MilvusStore(path, "model-a", DIM)
    try:
        assert same.mismatch is None
    finally:
        same.close()


def test_cache_entries_expire_after_their_ttl(cache: SemanticCache, clock: FakeClock) -> None:
    scope = CacheScope("ttl-tenant", "smollm2", "greedy")
    cache.store(scope, "what colour is the sky on mars", "butterscotch", ttl_seconds=30)
    assert cache.lookup(scope, "what colour is the sky on mars") is not None
    clock.now += 29
    hit = cache.lookup(scope, "what colour is the sky on mars")
    assert hit is not None and hit.age_seconds == pytest.approx(29)
    clock.now += 2
    assert cache.lookup(scope, "what colour is the sky on mars") is None


def test_cache_scope_separates_tenants_models_and_parameters(cache: SemanticCache) -> None:
    scope = CacheScope("scoped", "smollm2", "t=0")
    cache.store(scope, "how many legs does a spider have", "eight")
    assert cache.lookup(scope, "how many legs does a spider have") is not None
    for other in (
        CacheScope("scoped-other", "smollm2", "t=0"),
        CacheScope("scoped", "other-model", "t=0"),
        CacheScope("scoped", "smollm2", "t=0.7"),
    ):
        assert cache.lookup(other, "how many legs does a spider have") is None, other


def test_reingesting_a_cited_document_retires_the_cached_answer(
    cache: SemanticCache, corpus: Corpus, store: ObservedStore
) -> None:
    tenant = "cite"
    scope = CacheScope(tenant, "smollm2", "")
    corpus.ingest(tenant, upload("opening-hours", "the museum opens at nine"))
    corpus.ingest(tenant, upload("prices", "tickets cost ten euros"))
    cache.store(scope, "when does the museum open", "at nine", cited=[("opening-hours", 0)])
    cache.store(scope, "how much is a museum ticket", "ten euros", cited=[("prices", 1)])
    assert cache.lookup(scope, "when does the museum open") is not None

    corpus.ingest(tenant, upload("opening-hours", "the museum opens at ten"))
    assert cache.lookup(scope, "when does the museum open") is None
    # The other entry cited an unchanged document and still answers.
    hit = cache.lookup(scope, "how much is a museum ticket")
    assert hit is not None and hit.answer == "ten euros"
    assert store.count_cache_entries(tenant) == 1  # the retired entry was purged at lookup

    corpus.delete(tenant, "prices")
    assert cache.lookup(scope, "how much is a museum ticket") is None
    with pytest.raises(NotFound, match="cited document 'prices'"):
        cache.store(scope, "how much is a museum ticket", "ten euros", cited=[("prices", 0)])


def test_a_deleted_document_keeps_its_version_count_so_old_answers_stay_dead(
    cache: SemanticCache, corpus: Corpus, store: ObservedStore
) -> None:
    tenant = "tombstone"
    scope = CacheScope(tenant, "smollm2", "")
    first = corpus.ingest(tenant, upload("menu", "soup of the day is tomato"))
    cache.store(scope, "what is the soup of the day", "tomato", cited=[("menu", first.version)])
    assert corpus.delete(tenant, "menu") == first.chunks
    assert corpus.search(tenant, SearchQuery("soup of the day")) == []
    assert corpus.list(tenant, 10, "") == ([], "")
    with pytest.raises(NotFound):
        corpus.delete(tenant, "menu")

    again = corpus.ingest(tenant, upload("menu", "soup of the day is leek"))
    assert again.version == first.version + 1
    assert cache.lookup(scope, "what is the soup of the day") is None
    assert [r.document_id for r in corpus.list(tenant, 10, "")[0]] == ["menu"]


def test_a_cache_hit_replays_the_usage_stored_with_the_answer(cache: SemanticCache) -> None:
    scope = CacheScope("usage-tenant", "smollm2", "greedy")
    usage = AnswerUsage(prompt_tokens=41, completion_tokens=17, cached_prompt_tokens=32, finish_reason=2)
    stored = cache.store(scope, "how tall is the eiffel tower in paris", "330 metres", usage=usage)
    cache.store(scope, "what is the boiling point of water", "100 degrees")  # no usage given
    hit = cache.lookup(scope, "how tall is the eiffel tower in paris today")
    assert hit is not None and hit.entry_id == stored and hit.answer == "330 metres"
    assert hit.usage == usage
    plain = cache.lookup(scope, "what is the boiling point of water")
    assert plain is not None and plain.usage == AnswerUsage()


def create_first_cache_collection(path: str, scope: CacheScope, entries: dict[str, tuple[str, str]]) -> None:
    """The cache collection as the retriever made it before usage was kept, holding ``entries``."""
    client = MilvusClient(uri=path)
    try:
        schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("entry_id", DataType.VARCHAR, is_primary=True, max_length=64)
        schema.add_field("tenant_key", DataType.VARCHAR, max_length=64)
        schema.add_field("scope_key", DataType.VARCHAR, max_length=64)
        schema.add_field("prompt", DataType.VARCHAR, max_length=65_535)
        schema.add_field("answer", DataType.VARCHAR, max_length=65_535)
        schema.add_field("created_at_ms", DataType.INT64)
        schema.add_field("expires_at_ms", DataType.INT64)
        schema.add_field("cited", DataType.JSON)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=DIM)
        properties = {MODEL_PROPERTY: BagOfWordsFakeEmbedder.model_name, DIMENSION_PROPERTY: str(DIM)}
        client.create_collection(
            "llmmesh_semantic_cache", schema=schema, consistency_level="Strong", properties=properties
        )
        index = client.prepare_index_params()
        index.add_index(
            "vector", index_type="HNSW", metric_type="COSINE", params={"M": 16, "efConstruction": 200}
        )
        client.create_index("llmmesh_semantic_cache", index, sync=False)
        client.load_collection("llmmesh_semantic_cache")
        now_ms = int(FakeClock().now * 1000)
        rows = [
            {
                "entry_id": entry_id,
                "tenant_key": digest(scope.tenant),
                "scope_key": scope.key,
                "prompt": prompt,
                "answer": answer,
                "created_at_ms": now_ms,
                "expires_at_ms": now_ms + 600_000,
                "cited": [],
                "vector": BagOfWordsFakeEmbedder().embed([prompt])[0].tolist(),
            }
            for entry_id, (prompt, answer) in entries.items()
        ]
        client.upsert("llmmesh_semantic_cache", rows)
        client.flush("llmmesh_semantic_cache")
    finally:
        client.close()
        from milvus_lite.server_manager import server_manager_instance

        server_manager_instance.release_server(path)


def test_entries_of_the_cache_collection_without_usage_still_hit_with_usage_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "milvus.db")
    scope = CacheScope("upgraded", "smollm2", "greedy")
    old = {
        "old-1": ("who painted the mona lisa", "Leonardo"),
        "old-2": ("who wrote the odyssey", "Homer"),
        "old-3": ("who composed the four seasons", "Vivaldi"),
    }
    create_first_cache_collection(path, scope, old)
    monkeypatch.setattr("services.retriever.connection._MIGRATION_BATCH", 2)  # more than one round
    store = MilvusStore(path, BagOfWordsFakeEmbedder.model_name, DIM)
    try:
        assert store.names.legacy_cache not in store._client.list_collections()  # moved, then dropped
        cache = SemanticCache(store, BagOfWordsFakeEmbedder(), threshold=0.9, clock=FakeClock())
        for entry_id, (prompt, answer) in old.items():
            hit = cache.lookup(scope, prompt)
            assert hit is not None and (hit.entry_id, hit.answer) == (entry_id, answer)
            assert hit.usage == AnswerUsage()  # never recorded: zero, not guessed
        usage = AnswerUsage(prompt_tokens=9, completion_tokens=4, cached_prompt_tokens=0, finish_reason=1)
        cache.store(scope, "who sculpted the statue of david", "Michelangelo", usage=usage)
        new = cache.lookup(scope, "who sculpted the statue of david")
        assert new is not None and new.usage == usage
    finally:
        store.close()
    reopened = MilvusStore(path, BagOfWordsFakeEmbedder.model_name, DIM)  # nothing left to move
    try:
        assert reopened.count_cache_entries("upgraded") == 4
    finally:
        reopened.close()


def _recreate_as_first_chunk_schema(path: str, rows: list[dict[str, object]]) -> None:
    """Replaces the chunks collection by one of the schema before hybrid search (no BM25 field)."""
    client = MilvusClient(uri=path)
    try:
        names = CollectionNames.with_prefix("llmmesh")
        client.drop_collection(names.chunks)
        schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("chunk_id", DataType.VARCHAR, is_primary=True, max_length=128)
        for name in ("tenant_key", "document_key"):
            schema.add_field(name, DataType.VARCHAR, max_length=64)
        for name in ("document_id", "heading", "title"):
            schema.add_field(name, DataType.VARCHAR, max_length=1024)
        for name in ("version", "position", "page"):
            schema.add_field(name, DataType.INT64)
        schema.add_field("text", DataType.VARCHAR, max_length=65_535)
        schema.add_field("metadata", DataType.JSON)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=DIM)
        properties = {MODEL_PROPERTY: BagOfWordsFakeEmbedder.model_name, DIMENSION_PROPERTY: str(DIM)}
        assert names.legacy_chunks is not None
        client.create_collection(names.legacy_chunks, schema=schema, properties=properties)
        index = client.prepare_index_params()
        index.add_index(
            "vector", index_type="HNSW", metric_type="COSINE", params={"M": 16, "efConstruction": 200}
        )
        client.create_index(names.legacy_chunks, index, sync=False)
        client.load_collection(names.legacy_chunks)
        client.upsert(names.legacy_chunks, rows)
        client.flush(names.legacy_chunks)
    finally:
        client.close()
        from milvus_lite.server_manager import server_manager_instance

        server_manager_instance.release_server(path)


def test_chunks_of_the_schema_before_hybrid_search_are_moved_and_keyword_searchable(tmp_path: Path) -> None:
    path = str(tmp_path / "milvus.db")
    tenant = "upgraded"
    store = MilvusStore(path, BagOfWordsFakeEmbedder.model_name, DIM)
    corpus = Corpus(store, BagOfWordsFakeEmbedder(), TokenChunker(whitespace_token_spans))
    text = "# Harbour rules\n\nBoats moor at pier ZX-19 only.\n\n## Fees\n\nMooring costs four coins a night."
    assert corpus.ingest(tenant, DocumentUpload("harbour", text.encode(), "text/markdown")).version == 1
    fields = [
        "chunk_id", "tenant_key", "document_key", "document_id", "version", "position", "page",
        "heading", "title", "text", "metadata", "vector",
    ]  # fmt: skip
    rows = store._query(store.names.chunks, 'chunk_id != ""', fields)
    store.close()
    _recreate_as_first_chunk_schema(path, rows)

    store = MilvusStore(path, BagOfWordsFakeEmbedder.model_name, DIM)
    try:
        assert store.names.legacy_chunks not in store._client.list_collections()  # moved, then dropped
        corpus = Corpus(store, BagOfWordsFakeEmbedder(), TokenChunker(whitespace_token_spans))
        for mode in (1, 2, 3):
            hits = corpus.search(tenant, SearchQuery("ZX-19", top_k=1, mode=mode, rerank=False))
            assert [(h.document_id, h.document_version) for h in hits] == [("harbour", 1)], mode
        # Re-ingest continues the version and replaces the moved chunks.
        changed = text.replace("four coins", "five coins")
        assert (
            corpus.ingest(tenant, DocumentUpload("harbour", changed.encode(), "text/markdown")).version == 2
        )
        hits = corpus.search(tenant, SearchQuery("mooring coins", top_k=5, mode=2, rerank=False))
        assert {h.document_version for h in hits} == {2} and any("five coins" in h.text for h in hits)
    finally:
        store.close()


def test_metadata_past_its_total_size_is_refused_naming_the_field(corpus: Corpus) -> None:
    # 64 values of 1,024 characters each were accepted, and a page or a search of such
    # documents passed gRPC's 4 MiB message limit (RESOURCE_EXHAUSTED) for every later reader.
    tenant = "metadata-size"
    largest = {f"k{i:02d}": "v" * 1024 for i in range(64)}
    with pytest.raises(InvalidArgument) as refused:
        corpus.ingest(tenant, DocumentUpload("big", b"pump manual", "text/plain", metadata=largest))
    assert refused.value.field == "header.metadata"
    fits = {f"k{i}": "é" * 500 for i in range(4)}  # 4 × (2 + 1,000) bytes: under 8 KiB
    assert (
        corpus.ingest(tenant, DocumentUpload("ok", b"pump manual", "text/plain", metadata=fits)).chunks == 1
    )


def test_a_title_is_limited_in_stored_bytes_so_an_identical_resend_is_unchanged(
    corpus: Corpus, store: ObservedStore
) -> None:
    # 500 CJK characters passed a 512-character check, the store kept their first 1,024 bytes,
    # and the resend compared the whole title with the cut one: a new version every time.
    tenant = "long-titles"
    with pytest.raises(InvalidArgument) as refused:
        corpus.ingest(tenant, DocumentUpload("cjk", b"alpha beta", "text/plain", title="日" * 500))
    assert refused.value.field == "header.title"
    title = "é" * 512  # 1,024 bytes: the most the store keeps
    first = corpus.ingest(tenant, DocumentUpload("e", b"alpha beta", "text/plain", title=title))
    again = corpus.ingest(tenant, DocumentUpload("e", b"alpha beta", "text/plain", title=title))
    assert again.unchanged and again.version == first.version
    # A title taken from a long `source` skipped the check and was never "unchanged" either.
    source = "https://example.com/" + "report-" * 1000
    derived = corpus.ingest(tenant, DocumentUpload("src", b"alpha beta", "text/plain", source=source))
    resent = corpus.ingest(tenant, DocumentUpload("src", b"alpha beta", "text/plain", source=source))
    assert resent.unchanged and resent.version == derived.version
    stored = store.get_document(tenant, "src")
    assert stored is not None and source.rsplit("/", 1)[-1].startswith(stored.title)


def test_long_headings_never_push_a_chunks_own_words_out_of_the_keyword_index(store: ObservedStore) -> None:
    # The keyword text was title + heading path + text, cut at 64 KiB from the end: six long
    # nested headings left nothing of the chunk's own text, and a search for its words missed.
    corpus = Corpus(
        store,
        BagOfWordsFakeEmbedder(),
        TokenChunker(whitespace_token_spans, ChunkingPolicy(max_tokens=4000, overlap_tokens=2)),
    )
    tenant = "long-headings"
    heading = " ".join(["chapter"] * 1600)  # 12.8 KB each, 77 KB for the path of six
    markdown = "".join(f"{'#' * level} {heading} {level}\n\n" for level in range(1, 7))
    markdown += "The zebrafish regenerates its heart.\n"
    corpus.ingest(tenant, DocumentUpload("deep", markdown.encode(), "text/markdown", title="t" * 500))
    corpus.ingest(tenant, upload("other", "tomatoes grow in compost"))
    hits = corpus.search(tenant, SearchQuery("zebrafish", mode=SearchMode.KEYWORD.value, top_k=5))
    assert [h.text for h in hits] == ["The zebrafish regenerates its heart."]


class TruncatingFakeEmbedder(BagOfWordsFakeEmbedder):
    """Reads only its first ``max_tokens`` words, as a real embedding model drops what is past its input."""

    max_tokens = 12
    special_tokens = 0

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        return whitespace_token_spans(text)

    def embed(self, texts: Sequence[str]) -> Vectors:
        return super().embed([" ".join(t.split()[: self.max_tokens]) for t in texts])


def test_a_long_title_never_pushes_a_chunks_own_words_out_of_its_vector(store: ObservedStore) -> None:
    # Title, heading path and text were embedded as one, and the model dropped what was past
    # its input: chunks under one long title differing in their last words had one vector.
    corpus = Corpus(
        store,
        TruncatingFakeEmbedder(),
        TokenChunker(whitespace_token_spans, ChunkingPolicy(max_tokens=10, overlap_tokens=0)),
    )
    tenant = "long-title"
    title = "Annual report of the regional water authority for the year"  # 11 words
    endings = {"pumps": "rust", "meters": "leak", "valves": "stick"}
    for document_id, ending in endings.items():
        text = f"minutes of the board meeting noted that {document_id} {ending}"
        corpus.ingest(tenant, DocumentUpload(document_id, text.encode(), "text/plain", title=title))
    for document_id, ending in endings.items():
        hits = corpus.search(tenant, SearchQuery(f"{document_id} {ending}", mode=SearchMode.DENSE.value))
        assert hits[0].document_id == document_id, [h.document_id for h in hits]
        assert hits[0].score > hits[1].score


def test_a_charset_declared_for_json_and_json_lines_is_honoured(corpus: Corpus, store: ObservedStore) -> None:
    # Only text/* kept its charset: JSON in Windows-1252 was read as UTF-8 and refused with
    # advice to declare the charset it had declared.
    tenant = "json-charset"
    for document_id, mime_type, data in (
        ("menu.json", "application/json", '{"dish": "crème brûlée"}'),
        ("menu.jsonl", "application/x-ndjson", '{"dish": "crème brûlée"}\n{"dish": "café"}\n'),
        ("menu.csv", "application/csv", "dish,price\ncrème brûlée,7\n"),
    ):
        upload_ = DocumentUpload(
            document_id, data.encode("windows-1252"), f"{mime_type}; charset=windows-1252"
        )
        assert corpus.ingest(tenant, upload_).chunks >= 1
        record = store.get_document(tenant, document_id)
        assert record is not None and record.mime_type.endswith("charset=windows-1252")
    hits = corpus.search(tenant, SearchQuery("crème brûlée", mode=SearchMode.KEYWORD.value, top_k=5))
    assert hits and all("crème brûlée" in h.text for h in hits)


def test_a_charset_that_decodes_nothing_is_refused_on_the_mime_type(corpus: Corpus) -> None:
    # Python's "undefined" codec is found but raises on every decode: a bare UnicodeError.
    for mime_type in ("text/plain; charset=undefined", "application/json; charset=undefined"):
        with pytest.raises(InvalidArgument) as refused:
            corpus.ingest("charsets", DocumentUpload("doc", b'{"a": "b"}', mime_type))
        assert refused.value.field == "header.mime_type"


def test_a_long_params_fingerprint_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgument) as fingerprint:
        CacheScope("cache-fields", "smollm2", "f" * 257)
    assert fingerprint.value.field == "params_fingerprint"


def test_a_cited_version_the_document_never_had_is_refused(cache: SemanticCache, corpus: Corpus) -> None:
    # A version the document never had would pin the entry to content it was not built from,
    # and revive it once re-ingests reach that number.
    tenant = "future-version"
    scope = CacheScope(tenant, "smollm2", "")
    current = corpus.ingest(tenant, upload("menu", "soup of the day is tomato")).version
    with pytest.raises(InvalidArgument) as future:
        cache.store(scope, "what is the soup", "tomato", cited=[("menu", current + 1)])
    assert future.value.field == "cited.version"
    assert cache.store(scope, "what is the soup", "tomato", cited=[("menu", current)])


def test_keyword_mode_looks_for_chunks_over_min_score_no_deeper_than_its_bound(
    corpus: Corpus, store: ObservedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keyword order says nothing of the cosine: a minimum no match reaches read every match, up to
    Milvus's 16,384 rows with their texts, on each such request."""
    tenant = "keyword-depth"
    words = " ".join(f"XJ9Q7 f{i} mulch bed" for i in range(3000))  # ~2,000 chunks, each a match
    corpus.ingest(tenant, upload("many-matches", words))
    fetched: list[int] = []
    search_chunks = store.search_chunks

    def counting(*args: Any, **kwargs: Any) -> Any:
        fetched.append(args[4])
        return search_chunks(*args, **kwargs)

    monkeypatch.setattr(store, "search_chunks", counting)
    hits = corpus.search(tenant, SearchQuery("XJ9Q7", top_k=3, mode=SearchMode.KEYWORD.value, min_score=0.99))
    assert hits == []
    assert max(fetched) <= 1280 and len(fetched) >= 2, fetched  # it did look deeper, within the bound
