"""`python -m services.retriever`: documents and search on Milvus, plus the semantic cache."""

from __future__ import annotations

import os

from services.common.server import run
from services.common.settings import EnvArgumentParser, add_server_args, server_options
from services.retriever.config import RetrieverConfig
from services.retriever.document_locks import DEFAULT_LEASE_SECONDS, DEFAULT_WAIT_SECONDS
from services.retriever.embedder import DEFAULT_EMBEDDING_MODEL
from services.retriever.runtime import RetrieverRuntime


def main(argv: list[str] | None = None) -> None:
    # Models are read from local directories only; never let a library reach for the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = EnvArgumentParser(prog="python -m services.retriever", description=__doc__)
    add_server_args(parser, default_port=50053)
    parser.add_argument(
        "--milvus-uri", default="data/milvus.db", help="a *.db path (Milvus Lite) or http://host:port"
    )
    parser.add_argument(
        "--collection-prefix", default="llmmesh", help="prefix of the Milvus collection names"
    )
    parser.add_argument(
        "--embedding-model", default=DEFAULT_EMBEDDING_MODEL, help="sentence-transformers name or path"
    )
    parser.add_argument("--embedding-dimension", type=int, default=None, help="truncate vectors to this size")
    parser.add_argument("--device", default="cpu", help="embedding device: auto, cpu or cuda")
    parser.add_argument(
        "--max-document-bytes", type=int, default=20 * 1024 * 1024, help="largest upload accepted"
    )
    parser.add_argument("--chunk-tokens", type=int, default=200, help="chunk size in embedding-model tokens")
    parser.add_argument(
        "--chunk-overlap-tokens", type=int, default=40, help="tokens shared by neighbouring chunks"
    )
    parser.add_argument(
        "--cache-threshold", type=float, default=0.92, help="semantic-cache cosine similarity"
    )
    parser.add_argument(
        "--cache-ttl-seconds", type=int, default=7200, help="default semantic-cache entry lifetime"
    )
    parser.add_argument(
        "--milvus-timeout-seconds", type=float, default=10.0, help="bound on each Milvus call"
    )
    parser.add_argument("--search-ef", type=int, default=64, help="HNSW search breadth (recall vs speed)")
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Redis for per-document write leases: set it when several replicas share one Milvus",
    )
    parser.add_argument(
        "--redis-cluster", action="store_true", help="--redis-url names a node of a Redis Cluster"
    )
    parser.add_argument(
        "--document-lease-seconds",
        type=float,
        default=DEFAULT_LEASE_SECONDS,
        help="a writer's lease on a document, renewed while it writes",
    )
    parser.add_argument(
        "--document-lock-wait-seconds",
        type=float,
        default=DEFAULT_WAIT_SECONDS,
        help="how long a write waits for another replica's; beyond it ABORTED",
    )
    args = parser.parse_args(argv)
    try:
        config = RetrieverConfig(
            milvus_uri=args.milvus_uri,
            embedding_model=args.embedding_model,
            embedding_dimension=args.embedding_dimension,
            device=args.device,
            collection_prefix=args.collection_prefix,
            max_document_bytes=args.max_document_bytes,
            chunk_tokens=args.chunk_tokens,
            chunk_overlap_tokens=args.chunk_overlap_tokens,
            cache_threshold=args.cache_threshold,
            cache_ttl_seconds=args.cache_ttl_seconds,
            milvus_timeout_seconds=args.milvus_timeout_seconds,
            search_ef=args.search_ef,
            redis_url=args.redis_url or None,
            redis_cluster=args.redis_cluster,
            document_lease_seconds=args.document_lease_seconds,
            document_lock_wait_seconds=args.document_lock_wait_seconds,
        )
    except ValueError as exc:
        parser.error(str(exc))
    run(server_options("retriever", args), RetrieverRuntime(config))


if __name__ == "__main__":
    main()
