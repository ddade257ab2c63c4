"""The three Milvus collections' layouts: names, fields, indexes, and the older cache layout moved over."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pymilvus import DataType, Function, FunctionType, MilvusClient

from services.retriever.terms import keyword_text

# Recorded on the vector collections so a server with another model refuses them.
MODEL_PROPERTY = "llmmesh.embedding_model"
DIMENSION_PROPERTY = "llmmesh.embedding_dimension"
# VARCHAR limits are bytes; text fields are cut to fit rather than rejected.
MAX_TEXT_BYTES = 65_535
MAX_LABEL_BYTES = 1_024
# Milvus needs a vector field in every collection; the documents collection stores a constant one.
PLACEHOLDER_DIM = 2
# The usage columns of a cache entry: AnswerUsage's fields, one INT64 each.
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "finish_reason")
# The standard tokenizer (Milvus Lite has only it and jieba), lower-cased, English stop words and
# stems: a Milvus server applies all three; Milvus Lite 3.2.2 accepts the filters but, as measured,
# applies neither stop words nor stems (terms.py drops stop words from queries for both).
KEYWORD_ANALYZER = {
    "tokenizer": "standard",
    "filter": [
        "lowercase",
        {"type": "stop", "stop_words": ["_english_"]},
        {"type": "stemmer", "language": "english"},
    ],
}
# What the first cache schema stored (besides the vector): copied as they are when adopted.
_LEGACY_CACHE_FIELDS = (
    "entry_id",
    "tenant_key",
    "scope_key",
    "prompt",
    "answer",
    "created_at_ms",
    "expires_at_ms",
    "cited",
)

_LEGACY_CHUNK_FIELDS = (
    "chunk_id",
    "tenant_key",
    "document_key",
    "document_id",
    "version",
    "position",
    "page",
    "heading",
    "title",
    "text",
    "metadata",
)


@dataclass(frozen=True)
class CollectionNames:
    chunks: str
    documents: str
    cache: str
    #: A cache collection of an older schema (no usage fields), moved into ``cache`` at startup.
    legacy_cache: str | None = None
    #: A chunks collection of the schema before hybrid search (no BM25 field), moved into ``chunks``.
    legacy_chunks: str | None = None

    @classmethod
    def with_prefix(cls, prefix: str) -> CollectionNames:
        # Milvus Lite cannot add a field to an existing collection (AddCollectionField is not
        # implemented), so a new cache schema gets a new name and the old entries are moved over.
        return cls(
            f"{prefix}_chunks_v2",
            f"{prefix}_documents",
            f"{prefix}_semantic_cache_v2",
            legacy_cache=f"{prefix}_semantic_cache",
            legacy_chunks=f"{prefix}_chunks",
        )


def fit_bytes(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes without splitting a character."""
    encoded = text.encode()
    if len(encoded) <= limit:
        return text
    return encoded[:limit].decode(errors="ignore")


def _base_schema(pk: str, pk_length: int, dynamic: bool = False) -> Any:
    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=dynamic)
    schema.add_field(pk, DataType.VARCHAR, is_primary=True, max_length=pk_length)
    schema.add_field("tenant_key", DataType.VARCHAR, max_length=64)
    return schema


def _vector_index(metric: str = "COSINE", index_type: str = "HNSW") -> Any:
    index = MilvusClient.prepare_index_params()
    params = {"M": 16, "efConstruction": 200} if index_type == "HNSW" else {}
    index.add_index("vector", index_type=index_type, metric_type=metric, params=params)
    return index


def contextual_text(title: str, heading_path: tuple[str, ...] | list[str], text: str) -> str:
    """A chunk as it is embedded and keyword-indexed: its title and heading path, then its own text.

    A chunk about "its soil" then still says whose; ``RetrievedChunk.text`` stays the chunk's own text.
    """
    path = " > ".join(h for h in heading_path if h)
    return "\n".join(part for part in (title, path, text) if part)


def chunk_schema(dimension: int) -> tuple[Any, Any]:
    """The chunks collection: one row per chunk of each document version, with its vector.

    ``search_text`` (the contextual text) feeds Milvus's own BM25 function, which
    writes the ``sparse`` field that keyword and hybrid search read.
    """
    schema = _base_schema("chunk_id", 128)
    schema.add_field("document_key", DataType.VARCHAR, max_length=64)
    schema.add_field("document_id", DataType.VARCHAR, max_length=MAX_LABEL_BYTES)
    schema.add_field("version", DataType.INT64)
    schema.add_field("position", DataType.INT64)
    schema.add_field("page", DataType.INT64)
    schema.add_field("heading", DataType.VARCHAR, max_length=MAX_LABEL_BYTES)
    schema.add_field("title", DataType.VARCHAR, max_length=MAX_LABEL_BYTES)
    schema.add_field("text", DataType.VARCHAR, max_length=MAX_TEXT_BYTES)
    schema.add_field("metadata", DataType.JSON)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=dimension)
    schema.add_field(
        "search_text",
        DataType.VARCHAR,
        max_length=MAX_TEXT_BYTES,
        enable_analyzer=True,
        analyzer_params=KEYWORD_ANALYZER,
    )
    schema.add_field("sparse", DataType.SPARSE_FLOAT_VECTOR)
    schema.add_function(
        Function(
            name="search_text_bm25",
            function_type=FunctionType.BM25,
            input_field_names=["search_text"],
            output_field_names=["sparse"],
        )
    )
    index = _vector_index()
    index.add_index("sparse", index_type="SPARSE_INVERTED_INDEX", metric_type="BM25")
    return schema, index


def legacy_chunk_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A chunk of the schema before hybrid search in the current one.

    Its vector was already embedded from title, heading and text, so it is kept;
    only the keyword field is new (Milvus computes its BM25 vector on insert).
    """
    moved = {key: value for key, value in row.items() if key in _LEGACY_CHUNK_FIELDS}
    moved["vector"] = [float(x) for x in row["vector"]]
    moved["search_text"] = fit_bytes(
        keyword_text(contextual_text(row["title"], (row["heading"],), row["text"])), MAX_TEXT_BYTES
    )
    return moved


def document_schema() -> tuple[Any, Any]:
    """The documents collection: one record per document, its current version included."""
    schema = _base_schema("document_key", 64)
    schema.add_field("document_id", DataType.VARCHAR, max_length=MAX_LABEL_BYTES)
    schema.add_field("title", DataType.VARCHAR, max_length=MAX_LABEL_BYTES)
    schema.add_field("mime_type", DataType.VARCHAR, max_length=256)
    schema.add_field("source", DataType.VARCHAR, max_length=4096)
    schema.add_field("metadata", DataType.JSON)
    schema.add_field("content_hash", DataType.VARCHAR, max_length=64)
    schema.add_field("version", DataType.INT64)
    schema.add_field("chunks", DataType.INT64)
    schema.add_field("updated_at_ms", DataType.INT64)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=PLACEHOLDER_DIM)
    return schema, _vector_index("L2", "FLAT")


def cache_schema(dimension: int) -> tuple[Any, Any]:
    """The semantic cache: one entry per answered prompt, with the prompt's vector."""
    # Dynamic: a later per-entry fact can be written without another collection; readers
    # default what an older row lacks.
    schema = _base_schema("entry_id", 64, dynamic=True)
    # digest(tenant, model, params fingerprint): only entries in the same scope can match.
    schema.add_field("scope_key", DataType.VARCHAR, max_length=64)
    schema.add_field("prompt", DataType.VARCHAR, max_length=MAX_TEXT_BYTES)
    schema.add_field("answer", DataType.VARCHAR, max_length=MAX_TEXT_BYTES)
    schema.add_field("created_at_ms", DataType.INT64)
    schema.add_field("expires_at_ms", DataType.INT64)
    schema.add_field("cited", DataType.JSON)
    # The original answer's usage and finish reason (common.proto numbers), replayed by a hit.
    for name in USAGE_FIELDS:
        schema.add_field(name, DataType.INT64)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=dimension)
    return schema, _vector_index()


def legacy_cache_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row of the older cache schema in the current one: its usage was never recorded, so 0."""
    moved = {key: value for key, value in row.items() if key in _LEGACY_CACHE_FIELDS}
    moved["vector"] = [float(x) for x in row["vector"]]
    return {**moved, **dict.fromkeys(USAGE_FIELDS, 0)}
