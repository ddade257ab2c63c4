"""Retriever benchmark: quality per search mode, ingest throughput against a plain loop, and search at 10k chunks.

    python -m bench.retriever                          # defaults: ~1,000 embedded chunks, 10,000 in Milvus
    python -m bench.retriever --embedded-chunks 10000  # embed every chunk (slow on CPU)
    python -m bench.retriever --no-quality             # skip the evaluation-set part
    llm-mesh bench retriever --json bench/results/retriever.json

Quality (bench/retriever_quality.py): recall@1/@3/@5 and MRR per mode (dense,
keyword, hybrid, hybrid + rerank) and per question kind on the evaluation set
(bench/retrieval_eval.py), with readable and with neutral document ids.

The peer for ingest is a plain loop over the same chunk texts:
sentence-transformers ``encode`` in batches of 32 and a pymilvus ``insert`` into
a bare collection (id, text, vector; HNSW), then a flush: what ingest costs
without parsing, contextual text, BM25, versions and the flip.

Ingest runs the service's own pipeline in-process (parse → chunk → embed →
Milvus upsert with the version flip) on synthetic topic documents, and reports
chunks per second. For search, the collection is then filled up to
``--chunks`` vectors: the embedded chunks plus, if needed, synthetic vectors
drawn between them (a random point between two embedded chunks plus a little
Gaussian noise, re-normalized), so the set keeps the shape of real embeddings
without an hour of CPU embedding. Queries are embedded questions. Each query runs through Milvus (HNSW,
COSINE, tenant filter, Strong consistency) and through brute-force numpy cosine
over exactly the same vectors; we report p50/p95 latency of both, the speed
ratio, and Milvus's recall@10 against the exact answer. ``search_p50_ms`` is a
whole service-side search (query embedding + Milvus + current-version check);
``modes`` has it per mode, with and without the reranker (20 candidates), and
the Milvus call alone per mode. The synthetic fill chunks carry generated text
of realistic length, so BM25 searches 10,000 real-sized texts too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bench.timings import percentile
from services.retriever.chunking import ChunkingPolicy, TokenChunker
from services.retriever.corpus import Corpus, DocumentUpload, SearchQuery
from services.retriever.embedder import DEFAULT_EMBEDDING_MODEL, Embedder, Vectors, normalize_rows
from services.retriever.filters import digest
from services.retriever.records import ChunkRow, DocumentRecord
from services.retriever.rerank import CONTEXT_RERANKER, load_reranker
from services.retriever.search_modes import SearchMode
from services.retriever.store import MilvusStore

TENANT = "bench"
_TOPIC_WORDS = {
    "astronomy": "star galaxy orbit telescope planet comet nebula gravity eclipse moon light-year supernova",
    "baking": "flour dough oven yeast crust knead butter sugar proof loaf pastry crumb",
    "sailing": "wind sail hull keel tack harbour mast rudder knot anchor tide compass",
    "medicine": "patient dose symptom vaccine clinic diagnosis fever surgery nurse antibiotic blood scan",
    "finance": "interest loan bond equity dividend inflation budget tax account ledger audit market",
    "gardening": "soil seed compost prune root bloom mulch weed harvest greenhouse shade water",
    "networking": "packet router latency bandwidth protocol socket firewall subnet switch cable dns tls",
    "music": "chord melody rhythm tempo scale violin piano harmony choir concert score octave",
    "geology": "rock mineral fault quake basalt granite erosion sediment fossil crust magma quartz",
    "cycling": "chain gear brake tyre saddle pedal frame wheel spoke derailleur climb sprint",
    "law": "court judge contract appeal statute tenant lease verdict witness clause liability plaintiff",
    "cooking": "pan simmer garlic onion sauce roast spice broth knife chop grill season",
}
TOPICS: dict[str, list[str]] = {topic: words.split() for topic, words in _TOPIC_WORDS.items()}
_COMMON_WORDS = "the a of and to in is that for with on as by this it from at which when can be often most"
COMMON = _COMMON_WORDS.split()


@dataclass
class RetrieverBenchResult:
    when_utc: str
    machine: str
    embedding_model: str
    chunk_tokens: int
    search_ef: int
    documents: int
    embedded_chunks: int
    ingest_seconds: float
    ingest_chunks_per_s: float
    ingest_chunks_per_cpu_s: float
    milvus_chunks: int
    queries: int
    query_embed_p50_ms: float
    search_p50_ms: float
    search_p95_ms: float
    milvus_p50_ms: float
    milvus_p95_ms: float
    numpy_p50_ms: float
    numpy_p95_ms: float
    milvus_over_numpy_p50: float
    recall_at_10: float
    peer_ingest_chunks_per_s: float = 0.0
    ingest_over_peer: float = 0.0
    #: "<mode>[+rerank]" → {"search_p50_ms", "search_p95_ms"} (whole search), "<mode>:milvus" → Milvus alone.
    modes: dict[str, dict[str, float]] = field(default_factory=dict)
    #: bench/retriever_quality.py's rows, when it ran.
    quality: list[dict[str, object]] = field(default_factory=list)


def synthetic_document(rng: random.Random, topic: str, sentences: int) -> str:
    words = TOPICS[topic]
    lines = []
    for _ in range(sentences):
        picked = [
            rng.choice(words) if rng.random() < 0.55 else rng.choice(COMMON)
            for _ in range(rng.randint(8, 16))
        ]
        lines.append(" ".join(picked).capitalize() + ".")
    return " ".join(lines)


def synthetic_question(rng: random.Random) -> str:
    topic = rng.choice(sorted(TOPICS))
    return f"What about {' '.join(rng.sample(TOPICS[topic], 3))} {rng.choice(COMMON)} {rng.choice(TOPICS[topic])}?"


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {os.cpu_count()} CPUs, load average {load:.1f} at start"


def fill_vectors(
    store: MilvusStore, base: Vectors, count: int, seed: int, noise: float, sentences: int
) -> Vectors:
    """Writes ``count`` synthetic chunks (generated text, vectors shaped like ``base``), 100 per document."""
    rng = np.random.default_rng(seed)
    text_rng = random.Random(seed)
    topics = sorted(TOPICS)
    # A random point between two embedded chunks, jittered: spread like real embeddings, no duplicates.
    first = base[rng.integers(0, len(base), size=count)]
    second = base[rng.integers(0, len(base), size=count)]
    weight = np.asarray(rng.uniform(0.0, 1.0, size=(count, 1)), dtype=np.float32)
    mixed = weight * first + (1.0 - weight) * second
    vectors = normalize_rows(mixed + np.asarray(rng.normal(0.0, noise, size=mixed.shape), dtype=np.float32))
    for start in range(0, count, 100):
        block = vectors[start : start + 100]
        record = DocumentRecord(
            TENANT,
            f"fill-{start:06d}",
            "fill",
            "text/plain",
            "",
            {},
            "-",
            1,
            len(block),
            int(time.time() * 1000),
        )
        texts = [
            synthetic_document(text_rng, topics[(start + i) % len(topics)], sentences)
            for i in range(len(block))
        ]
        rows = [ChunkRow(i, text, "", 0, text) for i, text in enumerate(texts)]
        store.write_chunks(record, rows, block)
        store.put_document(record)
    return vectors


def exact_top_k(matrix: Vectors, query: Vectors, k: int) -> list[int]:
    scores = matrix @ query
    top = np.argpartition(-scores, k)[:k]
    return [int(i) for i in top[np.argsort(-scores[top])]]


def run_bench(args: argparse.Namespace) -> RetrieverBenchResult:
    rng = random.Random(args.seed)
    machine = machine_description()
    embedder = Embedder(args.embedding_model, device=args.device)
    chunker = TokenChunker(embedder.token_spans, ChunkingPolicy(args.chunk_tokens, args.chunk_tokens // 5))
    with tempfile.TemporaryDirectory(prefix="bench-retriever-") as tmp:
        store = MilvusStore(
            str(Path(tmp) / "milvus.db"), embedder.model_name, embedder.dimension, search_ef=args.search_ef
        )
        try:
            reranker, _ = load_reranker(CONTEXT_RERANKER, embedder)
            corpus = Corpus(store, embedder, chunker, reranker=reranker)
            topics = sorted(TOPICS)
            # ~ chunk_tokens*0.8 new tokens per chunk; a sentence is ~14 tokens.
            sentences = max(4, int(args.chunk_tokens * 0.8 * 10 / 14))
            documents = embedded = 0
            texts: list[str] = []
            started, cpu_started = time.perf_counter(), time.process_time()
            while embedded < args.embedded_chunks:
                text = synthetic_document(rng, topics[documents % len(topics)], sentences)
                texts.append(text)
                result = corpus.ingest(
                    TENANT, DocumentUpload(f"doc-{documents:05d}", text.encode(), "text/plain")
                )
                embedded += result.chunks
                documents += 1
            ingest_seconds = time.perf_counter() - started
            # CPU seconds of this process (all threads): comparable across loaded and idle machines.
            ingest_cpu_seconds = time.process_time() - cpu_started

            # Exactly what Milvus holds, read back, so both searches rank the same vectors.
            ids, base = read_back_vectors(store, embedder.dimension)
            if args.chunks > len(base):
                fill_vectors(store, base, args.chunks - len(base), args.seed, args.noise, sentences)
                ids, base = read_back_vectors(store, embedder.dimension)

            questions = [synthetic_question(rng) for _ in range(args.queries)]
            embed_ms = []
            query_vectors = []
            for question in questions:
                t0 = time.perf_counter()
                query_vectors.append(embedder.embed([question])[0])
                embed_ms.append((time.perf_counter() - t0) * 1000)

            # Let Milvus Lite finish building segment indexes in the background before timing.
            time.sleep(args.settle_seconds)
            milvus_ms, numpy_ms, recalls = [], [], []
            dense = SearchMode.DENSE
            for q, question in zip(query_vectors[:3], questions, strict=False):  # warm both paths
                store.search_chunks(TENANT, dense, question, q, 10, {})
                exact_top_k(base, q, 10)
            found = []
            for q, question in zip(query_vectors, questions, strict=True):
                t0 = time.perf_counter()
                found.append({h.chunk_id for h in store.search_chunks(TENANT, dense, question, q, 10, {})})
                milvus_ms.append((time.perf_counter() - t0) * 1000)
            # What a Search RPC does inside the service: embed, Milvus, current-version check.
            search_ms = []
            for question in questions:
                t0 = time.perf_counter()
                corpus.search(TENANT, SearchQuery(question, top_k=10, mode=dense.value, rerank=False))
                search_ms.append((time.perf_counter() - t0) * 1000)
            modes = time_modes(store, corpus, questions, query_vectors)
        finally:
            store.close()
    peer_rate = peer_ingest(embedder, chunker, texts)
    # Exact search once Milvus Lite's threads (pure Python, same process, same GIL) have stopped
    # and settled, so they do not slow numpy down; one untimed pass warms the caches.
    time.sleep(2.0)
    for q in query_vectors:
        exact_top_k(base, q, 10)
    for q, hits in zip(query_vectors, found, strict=True):
        t0 = time.perf_counter()
        exact = exact_top_k(base, q, 10)
        numpy_ms.append((time.perf_counter() - t0) * 1000)
        recalls.append(len({ids[i] for i in exact} & hits) / 10)
    return RetrieverBenchResult(
        when_utc=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine,
        embedding_model=embedder.model_name,
        chunk_tokens=args.chunk_tokens,
        search_ef=args.search_ef,
        documents=documents,
        embedded_chunks=embedded,
        ingest_seconds=round(ingest_seconds, 2),
        ingest_chunks_per_s=round(embedded / ingest_seconds, 1),
        ingest_chunks_per_cpu_s=round(embedded / max(ingest_cpu_seconds, 1e-9), 1),
        milvus_chunks=len(base),
        queries=len(query_vectors),
        query_embed_p50_ms=round(percentile(embed_ms, 50), 2),
        search_p50_ms=round(percentile(search_ms, 50), 2),
        search_p95_ms=round(percentile(search_ms, 95), 2),
        milvus_p50_ms=round(percentile(milvus_ms, 50), 2),
        milvus_p95_ms=round(percentile(milvus_ms, 95), 2),
        numpy_p50_ms=round(percentile(numpy_ms, 50), 3),
        numpy_p95_ms=round(percentile(numpy_ms, 95), 3),
        milvus_over_numpy_p50=round(percentile(milvus_ms, 50) / max(percentile(numpy_ms, 50), 1e-9), 1),
        recall_at_10=round(float(np.mean(recalls)), 4),
        peer_ingest_chunks_per_s=round(peer_rate, 1),
        ingest_over_peer=round(embedded / ingest_seconds / max(peer_rate, 1e-9), 3),
        modes=modes,
    )


def time_modes(
    store: MilvusStore, corpus: Corpus, questions: list[str], vectors: list[Vectors]
) -> dict[str, dict[str, float]]:
    """Whole-search p50/p95 per mode with and without the reranker, and the Milvus call per mode."""
    out: dict[str, dict[str, float]] = {}
    for mode in SearchMode:
        name = mode.name.lower()
        milvus = []
        for question, vector in zip(questions, vectors, strict=True):
            t0 = time.perf_counter()
            store.search_chunks(TENANT, mode, question, vector, 20, {})
            milvus.append((time.perf_counter() - t0) * 1000)
        out[f"{name}:milvus"] = {
            "p50_ms": round(percentile(milvus, 50), 2),
            "p95_ms": round(percentile(milvus, 95), 2),
        }
        for rerank in (False, True):
            timings = []
            for question in questions:
                query = SearchQuery(question, top_k=5, mode=mode.value, rerank=rerank, rerank_candidates=20)
                t0 = time.perf_counter()
                corpus.find(TENANT, query)
                timings.append((time.perf_counter() - t0) * 1000)
            out[name + ("+rerank" if rerank else "")] = {
                "p50_ms": round(percentile(timings, 50), 2),
                "p95_ms": round(percentile(timings, 95), 2),
            }
    return out


def peer_ingest(embedder: Embedder, chunker: TokenChunker, documents: list[str]) -> float:
    """Chunks/s of the plain loop: sentence-transformers encode + pymilvus insert + flush, same chunk texts."""
    from pymilvus import DataType, MilvusClient
    from sentence_transformers import SentenceTransformer

    from services.retriever.parsing import Section

    texts = [c.text for document in documents for c in chunker.chunk([Section(document)])]
    model = SentenceTransformer(embedder.location, device="cpu", local_files_only=True)
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        path = str(Path(tmp) / "peer.db")
        client = MilvusClient(path)
        try:
            schema = MilvusClient.create_schema(auto_id=False)
            schema.add_field("id", DataType.INT64, is_primary=True)
            schema.add_field("text", DataType.VARCHAR, max_length=65_535)
            schema.add_field("vector", DataType.FLOAT_VECTOR, dim=embedder.dimension)
            index = MilvusClient.prepare_index_params()
            index.add_index(
                "vector", index_type="HNSW", metric_type="COSINE", params={"M": 16, "efConstruction": 200}
            )
            client.create_collection("peer", schema=schema, index_params=index)
            started = time.perf_counter()
            for start in range(0, len(texts), 256):
                batch = texts[start : start + 256]
                vectors = model.encode(
                    batch, batch_size=32, normalize_embeddings=True, show_progress_bar=False
                )
                rows = [
                    {"id": start + i, "text": t, "vector": v.tolist()}
                    for i, (t, v) in enumerate(zip(batch, vectors, strict=True))
                ]
                client.insert("peer", rows)
            client.flush("peer")
            seconds = time.perf_counter() - started
        finally:
            client.close()
            from milvus_lite.server_manager import server_manager_instance

            server_manager_instance.release_server(path)
    return len(texts) / seconds


def read_back_vectors(store: MilvusStore, dimension: int) -> tuple[list[str], Vectors]:
    """Chunk ids and vectors of the bench tenant, as Milvus stores them."""
    client = store._client  # the bench reads raw rows; the service never needs to
    iterator = client.query_iterator(
        store.names.chunks,
        batch_size=1000,
        filter=f'tenant_key == "{digest(TENANT)}"',
        output_fields=["chunk_id", "vector"],
    )
    ids: list[str] = []
    rows: list[list[float]] = []
    try:
        while batch := iterator.next():
            ids += [row["chunk_id"] for row in batch]
            rows += [row["vector"] for row in batch]
    finally:
        iterator.close()
    return ids, np.asarray(rows, dtype=np.float32).reshape(-1, dimension)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=10_000, help="vectors in Milvus for the search phase")
    parser.add_argument(
        "--embedded-chunks", type=int, default=1_000, help="chunks ingested through the pipeline"
    )
    parser.add_argument("--chunk-tokens", type=int, default=200, help="chunk size in tokens")
    parser.add_argument("--queries", type=int, default=200, help="search queries to time")
    parser.add_argument(
        "--noise", type=float, default=0.01, help="std-dev per dimension of the synthetic fill"
    )
    parser.add_argument(
        "--embedding-model", default=DEFAULT_EMBEDDING_MODEL, help="sentence-transformers model"
    )
    parser.add_argument("--device", default="cpu", help="embedding device")
    parser.add_argument("--search-ef", type=int, default=64, help="HNSW ef, as the service's --search-ef")
    parser.add_argument(
        "--settle-seconds", type=float, default=10.0, help="pause for background index builds before timing"
    )
    parser.add_argument("--seed", type=int, default=7, help="random seed")
    parser.add_argument(
        "--no-quality", dest="quality", action="store_false", help="skip the evaluation-set quality part"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = run_bench(args)
    if args.quality:
        from bench.retriever_quality import run as run_quality

        result.quality = [asdict(row) for row in run_quality()]
    for key, value in asdict(result).items():
        if key == "quality":
            continue  # printed as tables by the quality run
        print(f"{key:>24}: {value}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.retriever", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
