"""Today's retriever (dense search) over the retrieval evaluation set: recall@1/@3/@5 and MRR per kind.

    python -m bench.retrieval_baseline                 # both id modes, Milvus Lite in a temporary dir
    python -m bench.retrieval_baseline --json bench/results/retrieval_baseline.json

The service's own code in-process: ``Corpus`` over ``MilvusStore`` (Milvus
Lite), the default embedder and chunker settings of ``RetrieverConfig``, each
document ingested with its title and file name as a client sends them. A
question's ranking is the documents of its top chunk hits in order, each
document once. Run once with descriptive ids and titles, once with neutral
ones (``doc-NNN``), where only the text tells look-alike documents apart.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from bench.retrieval_eval import (
    EvalQuestion,
    EvalSet,
    distinct,
    format_summary,
    load_eval_set,
    neutral_names,
    summarize,
)
from services.retriever.chunking import ChunkingPolicy, TokenChunker
from services.retriever.config import RetrieverConfig
from services.retriever.corpus import Corpus, DocumentUpload, SearchQuery
from services.retriever.embedder import Embedder
from services.retriever.search_modes import SearchMode
from services.retriever.store import MilvusStore

TENANT = "eval"
# Chunk hits fetched per question: enough for five distinct documents at ~3 chunks each.
CHUNK_HITS = 40


def dense_rankings(eval_set: EvalSet, corpus: Corpus) -> list[tuple[EvalQuestion, list[str]]]:
    """Ingests every document, then ranks documents for every question by today's dense search."""
    for document in eval_set.documents:
        corpus.ingest(
            TENANT,
            DocumentUpload(
                document.document_id,
                document.data,
                document.mime_type,
                title=document.title,
                source=document.filename,
            ),
        )
    results = []
    for question in eval_set.questions:
        # Dense only: the retriever's default became hybrid (issue #27); the baseline stays dense.
        query = SearchQuery(question.text, top_k=CHUNK_HITS, mode=SearchMode.DENSE.value)
        hits = corpus.search(TENANT, query)
        results.append((question, distinct(hit.document_id for hit in hits)))
    return results


def misses(results: list[tuple[EvalQuestion, list[str]]], names: Mapping[str, str]) -> list[str]:
    """One line per question whose first document is not a gold one: its kind, gold, top three.

    ``names`` maps neutral ids back to descriptive ones, so a reader sees which twin won.
    """

    def shown(ids: Sequence[str]) -> str:
        return ", ".join(f"{i} ({names[i]})" if i in names else i for i in ids)

    return [
        f"  {q.kind:<14}{shown(q.gold_document_ids)}  got {shown(ranked[:3])}  | {q.text}"
        for q, ranked in results
        if not ranked or ranked[0] not in q.gold_document_ids
    ]


def run_mode(
    neutral_ids: bool, config: RetrieverConfig, embedder: Embedder
) -> list[tuple[EvalQuestion, list[str]]]:
    chunker = TokenChunker(
        embedder.token_spans, ChunkingPolicy(config.chunk_tokens, config.chunk_overlap_tokens)
    )
    with tempfile.TemporaryDirectory(prefix="retrieval-baseline-") as tmp:
        store = MilvusStore(
            str(Path(tmp) / "milvus.db"), embedder.model_name, embedder.dimension, search_ef=config.search_ef
        )
        try:
            return dense_rankings(load_eval_set(neutral_ids=neutral_ids), Corpus(store, embedder, chunker))
        finally:
            store.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.retrieval_baseline", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the scores here")
    parser.add_argument("--show-misses", action="store_true", help="list the questions ranked wrong first")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = RetrieverConfig(milvus_uri="unused.db")
    embedder = Embedder(config.embedding_model, device=config.device)
    descriptive_ids = [d.document_id for d in load_eval_set().documents]
    names = {neutral: original for original, neutral in neutral_names(descriptive_ids).items()}
    report: dict[str, object] = {
        "when_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_at_start": os.getloadavg()[0],
        "embedding_model": embedder.model_name,
        "chunk_tokens": config.chunk_tokens,
    }
    for label, neutral in (("descriptive ids", False), ("neutral ids", True)):
        results = run_mode(neutral, config, embedder)
        summary = summarize(results)
        print(f"dense search, {label}:\n{format_summary(summary)}\n")
        if args.show_misses:
            print("\n".join(["missed at rank 1:", *misses(results, names if neutral else {})]) + "\n")
        report[label] = {kind: asdict(score) for kind, score in summary.items()}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
