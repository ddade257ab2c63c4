"""The retriever's settings, validated once at startup; its fields are the retriever's flags."""

from __future__ import annotations

from dataclasses import dataclass, fields

from services.common.settings import flag
from services.retriever.connection import check_milvus_uri, has_credentials, masked_milvus_uri
from services.retriever.document_locks import DEFAULT_LEASE_SECONDS, DEFAULT_WAIT_SECONDS
from services.retriever.embedder import DEFAULT_EMBEDDING_MODEL
from services.retriever.parsing import DEFAULT_MAX_PARSE_SECONDS
from services.retriever.rerank import DEFAULT_RERANK_MODEL
from services.retriever.semantic_cache import DEFAULT_THRESHOLD, DEFAULT_TTL_SECONDS, MAX_TTL_SECONDS


@dataclass(frozen=True)
class RetrieverConfig:
    milvus_uri: str = flag("data/milvus.db", help="a *.db path (Milvus Lite) or http://host:port")
    # Keeps a password out of the URI (which is easily printed) and, set from the environment
    # (a Kubernetes Secret), out of argv too. Never printed; see docs/retriever.md.
    milvus_token: str | None = flag(
        None,
        help="credentials for a Milvus with auth on: 'user:password' or an API key "
        "(set it in the environment: a flag's value is visible in ps)",
    )
    embedding_model: str = flag(DEFAULT_EMBEDDING_MODEL, help="sentence-transformers name or path")
    # None keeps the model's own dimension; smaller truncates the vectors.
    embedding_dimension: int | None = flag(None, type=int, help="truncate vectors to this size")
    device: str = flag("cpu", help="embedding device: auto, cpu or cuda")
    collection_prefix: str = flag("llmmesh", help="prefix of the Milvus collection names")
    max_document_bytes: int = flag(20 * 1024 * 1024, help="largest upload accepted")
    max_parse_seconds: float = flag(
        DEFAULT_MAX_PARSE_SECONDS,
        help="longest one document's text may take to read (PDFs); beyond it refused",
    )
    ingest_workers: int = flag(
        2, help="threads for Ingest and DeleteDocument, apart from the reads' (search, cache, embed)"
    )
    chunk_tokens: int = flag(200, help="chunk size in embedding-model tokens")
    chunk_overlap_tokens: int = flag(40, help="tokens shared by neighbouring chunks")
    cache_threshold: float = flag(DEFAULT_THRESHOLD, help="semantic-cache cosine similarity")
    cache_ttl_seconds: int = flag(DEFAULT_TTL_SECONDS, help="default semantic-cache entry lifetime")
    milvus_timeout_seconds: float = flag(10.0, help="bound on each Milvus call")
    milvus_check_seconds: float = flag(
        5.0, help="how often health checks Milvus once serving (NOT_SERVING while unreachable)"
    )
    search_ef: int = flag(64, help="HNSW search breadth (recall vs speed)")
    # docs/retriever.md: what each choice does and why "context" is the default.
    rerank_model: str = flag(
        DEFAULT_RERANK_MODEL,
        help="relevance reranker: 'none' (the default), a local sentence-transformers CrossEncoder "
        "directory, or 'context' (title/heading-aware, on the embedding model; measured weaker than hybrid)",
    )
    # Per-document write leases shared by every replica of one corpus (document_locks.py);
    # None: one writer per document per process, enough for a single replica.
    redis_url: str | None = flag(
        None, help="Redis for per-document write leases: set it when several replicas share one Milvus"
    )
    redis_cluster: bool = flag(False, help="--redis-url names a node of a Redis Cluster")
    document_lease_seconds: float = flag(
        DEFAULT_LEASE_SECONDS, help="a writer's lease on a document, renewed while it writes"
    )
    document_lock_wait_seconds: float = flag(
        DEFAULT_WAIT_SECONDS, help="how long a write waits for another replica's; beyond it ABORTED"
    )

    def __repr__(self) -> str:
        # The dataclass's own would print the token and the URI's password.
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["milvus_uri"] = masked_milvus_uri(self.milvus_uri)
        if self.milvus_token:
            shown["milvus_token"] = "***"
        return f"RetrieverConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def __post_init__(self) -> None:
        check_milvus_uri(self.milvus_uri)
        if self.milvus_token and has_credentials(self.milvus_uri):
            raise ValueError(
                "--milvus-token and credentials in --milvus-uri (user:password@): give them once, "
                "as --milvus-token (or LLMMESH_MILVUS_TOKEN), and leave them out of the URI"
            )
        if not self.collection_prefix.replace("_", "").isalnum() or not self.collection_prefix[0].isalpha():
            raise ValueError(
                f"--collection-prefix must be letters, digits and '_', got {self.collection_prefix!r}"
            )
        if self.embedding_dimension is not None and self.embedding_dimension < 1:
            raise ValueError(f"--embedding-dimension must be >= 1, got {self.embedding_dimension}")
        if self.max_document_bytes < 1:
            raise ValueError(f"--max-document-bytes must be >= 1, got {self.max_document_bytes}")
        if not self.max_parse_seconds > 0:  # NaN too
            raise ValueError(f"--max-parse-seconds must be > 0, got {self.max_parse_seconds}")
        if not -1.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"--cache-threshold must be in [-1, 1], got {self.cache_threshold}")
        if not 1 <= self.cache_ttl_seconds <= MAX_TTL_SECONDS:
            raise ValueError(
                f"--cache-ttl-seconds must be in 1..{MAX_TTL_SECONDS}, got {self.cache_ttl_seconds}"
            )
        if self.milvus_timeout_seconds <= 0:
            raise ValueError(f"--milvus-timeout-seconds must be > 0, got {self.milvus_timeout_seconds}")
        if not self.milvus_check_seconds > 0:  # NaN too
            raise ValueError(f"--milvus-check-seconds must be > 0, got {self.milvus_check_seconds}")
        if self.document_lease_seconds <= 0:
            raise ValueError(f"--document-lease-seconds must be > 0, got {self.document_lease_seconds}")
        if self.document_lock_wait_seconds < 0:
            raise ValueError(
                f"--document-lock-wait-seconds must be >= 0, got {self.document_lock_wait_seconds}"
            )
        if self.redis_cluster and not self.redis_url:
            raise ValueError("--redis-cluster needs --redis-url")
        if self.ingest_workers < 1:
            raise ValueError(f"--ingest-workers must be >= 1, got {self.ingest_workers}")
        if self.search_ef < 1:
            raise ValueError(f"--search-ef must be >= 1, got {self.search_ef}")
        if self.device not in {"auto", "cpu", "cuda"} and not self.device.startswith("cuda:"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
