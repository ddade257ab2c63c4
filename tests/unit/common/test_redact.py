"""Passwords in URLs are masked wherever a URL is printed."""

from __future__ import annotations

import pytest

from services.common.redact import masked_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:S3cret@10.0.0.5:6379/0", "redis://:***@10.0.0.5:6379/0"),
        ("rediss://app:S3cret@redis.svc:6380/1", "rediss://app:***@redis.svc:6380/1"),
        ("http://root:S3cret@milvus:19530", "http://root:***@milvus:19530"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),  # nothing to hide
        ("redis://app@127.0.0.1:6379/0", "redis://app@127.0.0.1:6379/0"),  # a user alone is no secret
        ("/data/milvus.db", "/data/milvus.db"),
        ("http://user:pw@[::1:6379", "***"),  # does not parse: masked whole, not printed raw
    ],
)
def test_a_urls_password_is_masked_and_nothing_else_changes(url: str, shown: str) -> None:
    assert masked_url(url) == shown
