"""Retrieval quality per search mode on the evaluation set (bench/retrieval_eval.py), in-process.

    python -m bench.retriever_quality            # both id modes, every search mode, a table each
    python -m bench.retriever_quality --json out.json

Every document of the set is ingested through the service's own pipeline
(parse → contextual chunks → embed → Milvus Lite with BM25), then each question
is searched in each mode; the ranked document ids (distinct, best first) are
scored by recall@1/@3/@5 and MRR per question kind. Run with readable and with
neutral document ids (``doc-NNN``: only the text tells twins apart).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.retrieval_eval import EvalSet, format_summary, load_eval_set, summarize
from services.retriever.chunking import TokenChunker
from services.retriever.corpus import Corpus, DocumentUpload, SearchQuery
from services.retriever.embedder import Embedder
from services.retriever.rerank import ContextReranker
from services.retriever.search_modes import SearchMode
from services.retriever.store import MilvusStore

TENANT = "eval"
# (label, mode, reranker weights or None): what the table rows compare. "cosine-led" is the first
# design (cosine + 0.3 label + 0.3 title, ignoring the search's order), kept to show why it lost.
_COSINE_LED = {"order_weight": 0.0, "cosine_weight": 1.0, "label_weight": 0.3, "title_weight": 0.3}
CONFIGS: tuple[tuple[str, SearchMode, dict[str, float] | None], ...] = (
    ("dense", SearchMode.DENSE, None),
    ("keyword", SearchMode.KEYWORD, None),
    ("hybrid", SearchMode.HYBRID, None),
    ("hybrid+rerank", SearchMode.HYBRID, {}),
    ("hybrid+rerank(cosine-led)", SearchMode.HYBRID, _COSINE_LED),
)
# Chunks fetched per question: enough to rank five distinct documents.
_CHUNKS = 20


@dataclass
class ModeQuality:
    config: str
    neutral_ids: bool
    search_p50_ms: float
    #: kind → {"questions", "recall" {k: value}, "mrr"}
    kinds: dict[str, Any]


def ranked_documents(corpus: Corpus, question: str, mode: SearchMode, rerank: bool) -> list[str]:
    hits = corpus.search(TENANT, SearchQuery(question, top_k=_CHUNKS, mode=mode.value, rerank=rerank))
    ranked: list[str] = []
    for hit in hits:
        if hit.document_id not in ranked:
            ranked.append(hit.document_id)
    return ranked


def evaluate(embedder: Embedder, eval_set: EvalSet, neutral_ids: bool, folder: Path) -> list[ModeQuality]:
    store = MilvusStore(str(folder / f"eval-{int(neutral_ids)}.db"), embedder.model_name, embedder.dimension)
    try:
        chunker = TokenChunker(embedder.token_spans)
        corpus = Corpus(store, embedder, chunker)
        for document in eval_set.documents:
            upload = DocumentUpload(
                document.document_id, document.data, document.mime_type, document.title, document.filename
            )
            corpus.ingest(TENANT, upload)
        results = []
        for label, mode, weights in CONFIGS:
            rerank = weights is not None
            searcher = Corpus(store, embedder, chunker, reranker=ContextReranker(embedder, **(weights or {})))
            timings, rows = [], []
            for question in eval_set.questions:
                started = time.perf_counter()
                rows.append((question, ranked_documents(searcher, question.text, mode, rerank)))
                timings.append(time.perf_counter() - started)
            summary = summarize(rows)
            print(f"\n{label} ({'neutral' if neutral_ids else 'readable'} ids)\n{format_summary(summary)}")
            timings.sort()
            results.append(
                ModeQuality(
                    label,
                    neutral_ids,
                    round(timings[len(timings) // 2] * 1000, 2),
                    {kind: asdict(score) for kind, score in summary.items()},
                )
            )
        return results
    finally:
        store.close()


def run(neutral: Sequence[bool] = (False, True)) -> list[ModeQuality]:
    embedder = Embedder()
    with tempfile.TemporaryDirectory(prefix="retrieval-eval-") as folder:
        out: list[ModeQuality] = []
        for neutral_ids in neutral:
            out += evaluate(embedder, load_eval_set(neutral_ids=neutral_ids), neutral_ids, Path(folder))
        return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--neutral-only", action="store_true", help="only the neutral-id run")
    args = parser.parse_args(argv)
    results = run((True,) if args.neutral_only else (False, True))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
