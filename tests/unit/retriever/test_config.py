"""Retriever settings are checked at startup, with messages that name the flag."""

from __future__ import annotations

import pytest

from services.retriever.config import RetrieverConfig


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"milvus_uri": "milvus"}, "--milvus-uri"),
        ({"milvus_uri": "ftp://host/db"}, "--milvus-uri"),
        ({"cache_threshold": 1.5}, "--cache-threshold"),
        ({"cache_ttl_seconds": 0}, "--cache-ttl-seconds"),
        ({"collection_prefix": "bad-prefix"}, "--collection-prefix"),
        ({"max_document_bytes": 0}, "--max-document-bytes"),
        ({"max_parse_seconds": 0}, "--max-parse-seconds"),
        ({"max_parse_seconds": float("nan")}, "--max-parse-seconds"),
        ({"device": "tpu"}, "--device"),
        ({"ingest_workers": 0}, "--ingest-workers"),
    ],
)
def test_bad_settings_name_their_flag(overrides: dict[str, object], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        RetrieverConfig(**overrides)  # type: ignore[arg-type]


def test_lite_paths_and_server_urls_are_both_accepted() -> None:
    assert RetrieverConfig(milvus_uri="data/milvus.db").milvus_uri == "data/milvus.db"
    assert RetrieverConfig(milvus_uri="http://milvus:19530").milvus_uri == "http://milvus:19530"
