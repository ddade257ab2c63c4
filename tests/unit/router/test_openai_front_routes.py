"""The OpenAI front's routes with no servers: the embedding model in ``/v1/models``, and paths with a
trailing slash. The pipeline and the retriever are stand-ins (the front only reads a few of their
fields); tests/integration/test_router_openai_synthetic.py and test_router_openai_mesh.py drive the
same behaviour through a real router with the OpenAI SDK."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import httpx
import pytest

from services.gen.llmmesh.v1 import common_pb2, retriever_pb2, router_pb2
from services.router.admission.auth import Authenticator
from services.router.api.openai.app import EMBEDDING_NAME_TTL_S, EMBEDDING_RETRY_S, OpenAiFront
from services.router.placement.models import ModelCatalog

EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"


class _Pool:
    def models(self) -> set[str]:
        return {"m"}


class _Services:
    pool = _Pool()
    catalog = ModelCatalog()
    rate_limiter = None
    inflight = None
    replay = None


class _Pipeline:
    """Answers every turn with two tokens: what the front frames is all these tests look at."""

    s = _Services()

    async def run_turn(
        self, principal: Any, turn: router_pb2.ChatRequest, *args: Any, **kwargs: Any
    ) -> AsyncIterator[router_pb2.ChatResponse]:
        yield router_pb2.ChatResponse(delta=router_pb2.TokenDelta(text="Hi", token_ids=[7]))
        yield router_pb2.ChatResponse(delta=router_pb2.TokenDelta(text="!", token_ids=[8], index=1))
        usage = common_pb2.Usage(prompt_tokens=4, completion_tokens=2)
        yield router_pb2.ChatResponse(
            end=router_pb2.TurnEnd(finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage, model="m")
        )


class _Retriever:
    """A RetrieverStub's Embed: names ``model``, or fails as a retriever that is down does."""

    def __init__(self, model: str = EMBEDDER) -> None:
        self.model = model
        self.down = False
        self.asked: list[list[str]] = []

    async def Embed(self, request: retriever_pb2.EmbedRequest, **kwargs: Any) -> retriever_pb2.EmbedResponse:
        self.asked.append(list(request.texts))
        if self.down:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "connection refused"
            )
        vectors = [retriever_pb2.Embedding(values=[0.6, 0.8]) for _ in request.texts]
        return retriever_pb2.EmbedResponse(embeddings=vectors, model=self.model, tokens=3)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def _client(
    retriever: _Retriever | None = None, clock: _Clock | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    front = OpenAiFront(
        _Pipeline(),  # type: ignore[arg-type]
        Authenticator(open_tenant="t"),
        clock=clock or _Clock(),
        retriever=lambda: retriever,
    )
    transport = httpx.ASGITransport(app=front.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
        yield client


async def _ids(client: httpx.AsyncClient) -> list[str]:
    response = await client.get("/v1/models")
    assert response.status_code == 200, response.text
    return [m["id"] for m in response.json()["data"]]


# -- the embedding model in /v1/models


async def test_the_retrievers_embedding_model_is_listed_after_the_chat_models_and_found() -> None:
    retriever = _Retriever()
    async with _client(retriever) as client:
        listed = (await client.get("/v1/models")).json()["data"]
        assert listed == [
            {"id": "m", "object": "model", "created": 0, "owned_by": "llm-mesh"},
            {"id": EMBEDDER, "object": "model", "created": 0, "owned_by": "llm-mesh"},
        ]
        found = await client.get(f"/v1/models/{EMBEDDER}")
        assert found.status_code == 200 and found.json()["id"] == EMBEDDER, found.text
        missing = await client.get("/v1/models/text-embedding-3-small")
        assert missing.status_code == 404 and EMBEDDER in missing.json()["error"]["message"]
    # The name is what the retriever said (asked once, with one word), not one the front made up.
    assert retriever.asked == [["llm-mesh"]]


async def test_without_a_retriever_only_chat_models_are_listed() -> None:
    async with _client(None) as client:
        assert await _ids(client) == ["m"]
        assert (await client.get(f"/v1/models/{EMBEDDER}")).status_code == 404


async def test_the_name_is_kept_a_while_then_asked_again() -> None:
    retriever, clock = _Retriever(), _Clock()
    async with _client(retriever, clock) as client:
        assert await _ids(client) == ["m", EMBEDDER]
        retriever.model = "BAAI/bge-small-en-v1.5"  # the retriever restarted on another model
        clock.now += EMBEDDING_NAME_TTL_S - 1
        assert await _ids(client) == ["m", EMBEDDER] and len(retriever.asked) == 1
        clock.now += 2
        assert await _ids(client) == ["m", "BAAI/bge-small-en-v1.5"] and len(retriever.asked) == 2
        # An embeddings reply renews the name at no extra ask.
        retriever.model = EMBEDDER
        embedded = await client.post("/v1/embeddings", json={"input": "a cat"})
        assert embedded.status_code == 200 and embedded.json()["model"] == EMBEDDER, embedded.text
        assert await _ids(client) == ["m", EMBEDDER] and len(retriever.asked) == 3


async def test_a_retriever_that_does_not_answer_leaves_the_list_whole_without_its_model() -> None:
    retriever, clock = _Retriever(), _Clock()
    retriever.down = True
    async with _client(retriever, clock) as client:
        assert await _ids(client) == ["m"]
        assert await _ids(client) == ["m"] and len(retriever.asked) == 1  # not asked on every list
        retriever.down = False
        clock.now += EMBEDDING_RETRY_S
        assert await _ids(client) == ["m", EMBEDDER]


async def test_a_chat_model_is_found_without_asking_the_retriever() -> None:
    retriever = _Retriever()
    async with _client(retriever) as client:
        assert (await client.get("/v1/models/m")).status_code == 200
    assert retriever.asked == []


# -- one trailing slash


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _routes() -> Iterator[tuple[str, str, dict[str, Any] | None]]:
    yield "POST", "/v1/chat/completions", CHAT
    yield "POST", "/v1/chat/completions", {**CHAT, "stream": True}
    yield "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}
    yield "POST", "/v1/responses", {"model": "m", "input": "hi"}
    yield "POST", "/v1/embeddings", {"input": "a cat"}
    yield "GET", "/v1/models", None
    yield "GET", "/v1/models/m", None
    yield "GET", f"/v1/models/{EMBEDDER}", None
    yield "GET", "/v1/responses/resp_1", None  # a 404 of its own (not stored), the same either way
    yield "GET", "/health", None
    yield "GET", "/v1/chat/completions", None  # 405 with Allow, the same either way


def _comparable(response: httpx.Response) -> Any:
    """What a client reads, less its time."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        data = [
            line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")
        ]
        return [d if d == "[DONE]" else _steady(json.loads(d)) for d in data]
    return _steady(response.json())


def _steady(body: Any) -> Any:
    if isinstance(body, dict):
        for varying in ("created", "created_at"):
            body.pop(varying, None)
    return body


@pytest.mark.parametrize(("method", "path", "body"), list(_routes()))
async def test_every_route_answers_the_same_with_one_trailing_slash(
    method: str, path: str, body: dict[str, Any] | None
) -> None:
    async with _client(_Retriever()) as client:
        same_id = {"x-request-id": "req-1"}  # the answers' ids come from it
        plain = await client.request(method, path, json=body, headers=same_id)
        slashed = await client.request(method, path + "/", json=body, headers=same_id)
    # Was a 307 to the path without the slash, with an empty body.
    assert slashed.status_code == plain.status_code, slashed.text
    assert "location" not in slashed.headers
    assert slashed.headers.get("allow") == plain.headers.get("allow")
    if method == "POST":
        assert slashed.status_code == 200 and ("Hi" in slashed.text or "embedding" in slashed.text), (
            slashed.text
        )
    assert _comparable(slashed) == _comparable(plain)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions//"),  # one slash more is the route; two are not (was a 307)
        ("POST", "/v1/chat/complete/"),
        ("GET", "/v1/"),
        ("GET", "/"),
        ("POST", "/v2/chat/completions"),
    ],
)
async def test_an_unknown_path_is_a_404_in_openai_shape_naming_it(method: str, path: str) -> None:
    async with _client() as client:
        response = await client.request(method, path, json={})
    assert response.status_code == 404, response.text
    assert response.json() == {
        "error": {
            "message": f"{method} {path}: Not Found",
            "type": "invalid_request_error",
            "param": None,
            "code": "unknown_url",
        }
    }
