"""Milvus credentials never reach a message, a log line or a repr; --milvus-token keeps them out of the URI.

pymilvus reads ``user:password`` (or a token alone) from the URI's userinfo, and the URI
was what "Milvus at … is unreachable" named: the router hands that message to tenants, and
the retriever logged it every 5 s while retrying.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar

import pytest
from pymilvus.exceptions import MilvusException

from services.common.errors import DependencyUnavailable
from services.retriever import __main__ as retriever_main
from services.retriever import connection
from services.retriever.config import RetrieverConfig
from services.retriever.connection import MilvusCollections
from services.retriever.runtime import RetrieverRuntime

PASSWORD = "MilvusPW123"
URI = f"http://root:{PASSWORD}@milvus.internal:19530"


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        (URI, "http://root:***@milvus.internal:19530"),
        ("https://root:p%40ss@host:443/db1", "https://root:***@host:443/db1"),
        ("http://root:p@ss@host:19530", "http://root:***@host:19530"),  # an unescaped @ in the password
        ("http://sk-APIKEY@host:19530", "http://***@host:19530"),  # a token alone is a secret too
        ("http://:pw@host:19530", "http://***@host:19530"),
        ("http://root:pa/ss@host:19530", "***"),  # a / cuts the authority short: shown as nothing
        ("http://[bad@host", "***"),
        ("http://milvus:19530", "http://milvus:19530"),
        ("data/milvus.db", "data/milvus.db"),
        ("/home/a@b/milvus.db", "/home/a@b/milvus.db"),  # a file name, not credentials
    ],
)
def test_masked_uri_hides_userinfo(uri: str, shown: str) -> None:
    assert connection.masked_milvus_uri(uri) == shown


def test_a_bad_uri_is_refused_without_quoting_its_password() -> None:
    with pytest.raises(ValueError, match="--milvus-uri") as caught:
        RetrieverConfig(milvus_uri=f"root:{PASSWORD}@milvus:19530")
    assert PASSWORD not in str(caught.value) and "***" in str(caught.value)


def test_config_repr_shows_neither_the_password_nor_the_token() -> None:
    assert PASSWORD not in repr(RetrieverConfig(milvus_uri=URI))
    config = RetrieverConfig(milvus_uri="http://milvus:19530", milvus_token=f"root:{PASSWORD}")
    assert PASSWORD not in repr(config)
    assert "milvus_token='***'" in repr(config)


def test_token_and_credentials_in_the_uri_together_are_refused() -> None:
    with pytest.raises(ValueError, match="--milvus-token") as caught:
        RetrieverConfig(milvus_uri=URI, milvus_token="root:other")
    assert PASSWORD not in str(caught.value) and "other" not in str(caught.value)


class _UnreachableClient:
    """Stands in for pymilvus's MilvusClient against a Milvus that is down."""

    made: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, **kwargs: Any) -> None:
        _UnreachableClient.made.append(kwargs)
        raise MilvusException(
            code=2,
            message="Fail connecting to server on milvus.internal:19530, illegal connection params "
            "or server unavailable",
        )


@pytest.fixture()
def unreachable(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    _UnreachableClient.made = []
    monkeypatch.setattr(connection, "MilvusClient", _UnreachableClient)
    return _UnreachableClient.made


def test_unreachable_milvus_is_named_without_its_credentials(unreachable: list[dict[str, Any]]) -> None:
    with pytest.raises(DependencyUnavailable) as caught:
        MilvusCollections(URI, "model", 8, timeout_s=1)
    message = str(caught.value)
    assert message.startswith(
        "Milvus at http://root:***@milvus.internal:19530 is unreachable: Fail connecting"
    )
    assert PASSWORD not in message
    # pymilvus gets the URI as given: it reads the credentials from it.
    assert unreachable == [{"uri": URI, "token": "", "timeout": 1}]


def test_the_token_goes_to_pymilvus_and_nowhere_else(unreachable: list[dict[str, Any]]) -> None:
    with pytest.raises(DependencyUnavailable) as caught:
        MilvusCollections("http://milvus.internal:19530", "model", 8, timeout_s=1, token=f"root:{PASSWORD}")
    assert unreachable[0]["token"] == f"root:{PASSWORD}"
    assert PASSWORD not in str(caught.value)


def test_a_credential_pymilvus_quotes_is_scrubbed_from_its_message_and_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def quoting(**kwargs: Any) -> None:
        raise MilvusException(code=1, message=f"uri: {kwargs['uri']} is illegal; token {kwargs['token']}")

    monkeypatch.setattr(connection, "MilvusClient", quoting)
    with pytest.raises(MilvusException) as caught:
        MilvusCollections(URI, "model", 8, timeout_s=1)
    assert PASSWORD not in str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    with pytest.raises(MilvusException) as caught:
        MilvusCollections("http://milvus.internal:19530", "model", 8, timeout_s=1, token="sk-SECRETKEY")
    assert "sk-SECRETKEY" not in str(caught.value)


def _parsed(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> RetrieverConfig:
    """The config ``python -m services.retriever`` builds from ``argv`` and the environment."""
    started: list[RetrieverRuntime] = []
    monkeypatch.setattr(retriever_main, "run", lambda options, runtime: started.append(runtime))
    retriever_main.main(argv)
    started[0].servicer.close()
    return started[0].config


def test_the_token_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMMESH_MILVUS_TOKEN", f"root:{PASSWORD}")
    config = _parsed(monkeypatch, ["--milvus-uri", "http://milvus:19530"])
    assert config.milvus_token == f"root:{PASSWORD}"
    monkeypatch.setenv("LLMMESH_MILVUS_TOKEN", "")  # empty: none
    assert _parsed(monkeypatch, ["--milvus-uri", "http://milvus:19530"]).milvus_token is None
    monkeypatch.delenv("LLMMESH_MILVUS_TOKEN")
    assert _parsed(monkeypatch, ["--milvus-token", "sk-KEY"]).milvus_token == "sk-KEY"


def test_start_up_retries_log_the_masked_uri(
    monkeypatch: pytest.MonkeyPatch, unreachable: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """The warning start-up logs before each retry (every 5 s while Milvus is away)."""
    runtime = RetrieverRuntime(RetrieverConfig(milvus_uri=URI, milvus_timeout_seconds=1))

    class _Embedder:
        model_name, dimension = "model", 8

    async def attempts() -> None:
        task = asyncio.create_task(runtime._open_store(_Embedder()))  # type: ignore[arg-type]
        while len(unreachable) < 2:
            await asyncio.sleep(0.05)
        task.cancel()

    monkeypatch.setattr("services.retriever.runtime._RETRY_SECONDS", (0.01,))
    with caplog.at_level(logging.WARNING, logger="llmmesh.retriever"):
        asyncio.run(attempts())
    runtime.servicer.close()
    assert "Milvus at http://root:***@milvus.internal:19530 is unreachable" in caplog.text
    assert PASSWORD not in caplog.text
    assert PASSWORD not in runtime.servicer.not_ready_reason
