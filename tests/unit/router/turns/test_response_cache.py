"""Response caches: which requests are cacheable, exact cache in real Redis, semantic cache over gRPC."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
import redis.asyncio as aioredis

from services.common import errors
from services.common.metadata import TENANT_KEY, metadata_value
from services.gen.llmmesh.v1 import common_pb2, retriever_pb2, retriever_pb2_grpc
from services.router.admission.breaker import CircuitBreaker
from services.router.turns.response_cache import (
    CachedAnswer,
    ExactCache,
    SemanticCache,
    exact_cache_key,
    sampling_fingerprint,
)
from tests.support.redis import RedisServer

MESSAGES = [("user", "What is 2+2?")]


def greedy(**kw: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, **kw)  # type: ignore[arg-type]


def test_only_deterministic_requests_have_a_key() -> None:
    assert exact_cache_key("m", MESSAGES, greedy(max_tokens=8)) is not None
    assert exact_cache_key("m", MESSAGES, common_pb2.SamplingParams(temperature=0.7, seed=3)) is not None
    assert exact_cache_key("m", MESSAGES, common_pb2.SamplingParams(temperature=0.7)) is None
    # Unset temperature means the server default 1.0: random.
    assert exact_cache_key("m", MESSAGES, common_pb2.SamplingParams()) is None


def test_key_changes_with_anything_that_changes_the_answer() -> None:
    base = exact_cache_key("m", MESSAGES, greedy(max_tokens=8))
    assert base == exact_cache_key("m", list(MESSAGES), greedy(max_tokens=8))
    assert base != exact_cache_key("other", MESSAGES, greedy(max_tokens=8))
    assert base != exact_cache_key("m", [("user", "What is 2+3?")], greedy(max_tokens=8))
    assert base != exact_cache_key("m", MESSAGES, greedy(max_tokens=9))
    assert base != exact_cache_key("m", MESSAGES, greedy(max_tokens=8, stop=["\n"]))
    assert exact_cache_key("m", MESSAGES, greedy(max_tokens=8, stop=["\n"])) != exact_cache_key(
        "m", MESSAGES, greedy(max_tokens=8, stop=["\n"], include_stop_str_in_output=True)
    )
    assert base != exact_cache_key("m", MESSAGES, greedy(max_tokens=8, presence_penalty=0.5))
    assert base != exact_cache_key("m", MESSAGES, greedy(max_tokens=8, frequency_penalty=0.5))
    assert base != exact_cache_key("m", MESSAGES, greedy(max_tokens=8, logit_bias={42: -100.0}))
    assert exact_cache_key("m", MESSAGES, greedy(max_tokens=8, logit_bias={42: -100.0})) != exact_cache_key(
        "m", MESSAGES, greedy(max_tokens=8, logit_bias={42: 100.0})
    )
    # Zero penalties are off: the key of a plain request (and of every entry cached before them).
    assert base == exact_cache_key("m", MESSAGES, greedy(max_tokens=8, presence_penalty=0.0))
    # Greedy ignores the seed and min_p, so they must not split the cache.
    assert base == exact_cache_key("m", MESSAGES, greedy(max_tokens=8, seed=7))
    assert base == exact_cache_key("m", MESSAGES, greedy(max_tokens=8, min_p=0.2))
    seeded = common_pb2.SamplingParams(temperature=0.7, seed=1)
    assert sampling_fingerprint(seeded) != sampling_fingerprint(
        common_pb2.SamplingParams(temperature=0.7, seed=1, min_p=0.2)
    )
    assert sampling_fingerprint(common_pb2.SamplingParams(temperature=0.7, seed=1)) != sampling_fingerprint(
        common_pb2.SamplingParams(temperature=0.7, seed=2)
    )


@pytest.fixture()
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url, socket_connect_timeout=0.5)
    yield client
    await client.aclose()


async def test_exact_cache_round_trip_is_per_tenant_and_expires(redis_client: aioredis.Redis) -> None:
    cache = ExactCache(redis_client, ttl_s=60)
    key = exact_cache_key("m", MESSAGES, greedy())
    assert key is not None
    answer = CachedAnswer(text="4", token_ids=[19], model="m", prompt_tokens=12, completion_tokens=1)
    await cache.put("acme", key, answer)
    assert await cache.get("acme", key) == answer
    assert await cache.get("globex", key) is None
    assert 0 < await redis_client.ttl(ExactCache.redis_key("acme", key)) <= 60


async def test_exact_cache_skips_cancelled_answers(redis_client: aioredis.Redis) -> None:
    cache = ExactCache(redis_client)
    await cache.put(
        "acme", "k", CachedAnswer(text="partial", finish_reason=common_pb2.FINISH_REASON_CANCELLED)
    )
    assert await cache.get("acme", "k") is None


async def test_exact_cache_outage_is_dependency_unavailable_then_fast(redis_server: RedisServer) -> None:
    client = aioredis.from_url(redis_server.url, socket_connect_timeout=0.5)
    try:
        cache = ExactCache(client, breaker=CircuitBreaker("exact-cache", failure_threshold=2))
        redis_server.kill()
        for _ in range(2):
            with pytest.raises(errors.DependencyUnavailable, match="exact-cache unavailable"):
                await cache.get("acme", "k")
        with pytest.raises(errors.DependencyUnavailable, match="circuit open"):
            await cache.get("acme", "k")
    finally:
        await client.aclose()


class FakeRetrieverCache(retriever_pb2_grpc.RetrieverServicer):
    """Stands in for the retriever's semantic cache: exact prompt match, per tenant, threshold echoed."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str, str, str], str] = {}
        self.thresholds: list[float | None] = []

    async def CacheStore(
        self, request: retriever_pb2.CacheStoreRequest, context: grpc.aio.ServicerContext
    ) -> retriever_pb2.CacheStoreResponse:
        tenant = metadata_value(context.invocation_metadata(), TENANT_KEY) or ""
        self.entries[(tenant, request.prompt, request.model, request.params_fingerprint)] = request.answer
        return retriever_pb2.CacheStoreResponse(entry_id=f"e{len(self.entries)}")

    async def CacheLookup(
        self, request: retriever_pb2.CacheLookupRequest, context: grpc.aio.ServicerContext
    ) -> retriever_pb2.CacheLookupResponse:
        tenant = metadata_value(context.invocation_metadata(), TENANT_KEY) or ""
        self.thresholds.append(request.threshold if request.HasField("threshold") else None)
        answer = self.entries.get((tenant, request.prompt, request.model, request.params_fingerprint))
        if answer is None:
            return retriever_pb2.CacheLookupResponse(hit=False)
        return retriever_pb2.CacheLookupResponse(
            hit=True, answer=answer, similarity=0.99, cached_prompt=request.prompt
        )


@pytest.fixture()
async def fake_retriever() -> AsyncIterator[tuple[FakeRetrieverCache, retriever_pb2_grpc.RetrieverStub]]:
    servicer = FakeRetrieverCache()
    server = grpc.aio.server()
    retriever_pb2_grpc.add_RetrieverServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, retriever_pb2_grpc.RetrieverStub(channel)
    await channel.close()
    await server.stop(None)


async def test_semantic_cache_sends_tenant_and_replays_the_answer(
    fake_retriever: tuple[FakeRetrieverCache, retriever_pb2_grpc.RetrieverStub],
) -> None:
    servicer, stub = fake_retriever
    cache = SemanticCache(stub)  # type: ignore[arg-type]
    fp = sampling_fingerprint(greedy())
    assert await cache.lookup("acme", "capital of France?", "m", fp) is None
    await cache.store("acme", "capital of France?", "m", fp, CachedAnswer(text="Paris"), cited=[("doc1", 2)])
    hit = await cache.lookup("acme", "capital of France?", "m", fp, threshold=0.8)
    assert hit is not None and hit.text == "Paris" and hit.similarity == pytest.approx(0.99)
    assert await cache.lookup("globex", "capital of France?", "m", fp) is None
    assert servicer.thresholds[0] is None and servicer.thresholds[1] == pytest.approx(0.8)
    with pytest.raises(errors.InvalidArgument, match="semantic_threshold"):
        await cache.lookup("acme", "x", "m", fp, threshold=1.5)


async def test_semantic_cache_outage_is_dependency_unavailable() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    try:
        cache = SemanticCache(retriever_pb2_grpc.RetrieverStub(channel), timeout_s=1)  # type: ignore[arg-type]
        with pytest.raises(errors.DependencyUnavailable, match="semantic-cache unavailable: UNAVAILABLE"):
            await cache.lookup("acme", "x", "m", "fp")
    finally:
        await channel.close()
