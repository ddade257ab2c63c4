"""The retriever's breaker against a real in-process gRPC retriever stub: one tenant's slow searches
(rerank, a large top_k) time out at the router's own per-call deadline, yet RAG stays on for every
other tenant; a retriever that answers nothing still opens the breaker, and a slow request that is
the half-open probe does not keep it open while cheap searches are answered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from services.common import errors
from services.gen.llmmesh.v1 import retriever_pb2, retriever_pb2_grpc, router_pb2
from services.router.admission.breaker import BreakerState, CircuitBreaker
from services.router.turns.context import ConversationContext

#: The router's per-call deadline in these tests (2 s in production): well under the slow searches'
#: time, well over a fast search's on a busy 2-core machine.
TIMEOUT_S = 1.0
SLOW_S = 5.0

CHUNK = retriever_pb2.RetrievedChunk(chunk_id="c1", document_id="handbook", text="25 days a year.", score=0.8)
HEAVY = router_pb2.RagOptions(enabled=True, top_k=20, rerank=True)
LIGHT = router_pb2.RagOptions(enabled=True)


class SlowForHeavySearches(retriever_pb2_grpc.RetrieverServicer):
    """Answers cheap searches at once; reranked or large searches (or, when ``hung``, every search)
    take ``SLOW_S``, far past the router's deadline: a retriever that is up, but slow for some work."""

    def __init__(self) -> None:
        self.hung = False
        self.calls = 0

    async def Search(
        self, request: retriever_pb2.SearchRequest, context: grpc.aio.ServicerContext
    ) -> retriever_pb2.SearchResponse:
        self.calls += 1
        if self.hung or request.rerank or request.top_k > 10:
            await asyncio.sleep(SLOW_S)
        return retriever_pb2.SearchResponse(chunks=[CHUNK])


@dataclass
class Mesh:
    retriever: SlowForHeavySearches
    context: ConversationContext
    breaker: CircuitBreaker


@pytest.fixture()
async def mesh() -> AsyncIterator[Mesh]:
    service = SlowForHeavySearches()
    server = grpc.aio.server()
    retriever_pb2_grpc.add_RetrieverServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    breaker = CircuitBreaker("retriever", failure_threshold=3, reset_timeout_s=1.0)
    context = ConversationContext(
        None,
        retriever_pb2_grpc.RetrieverStub(channel),  # type: ignore[arg-type]
        breakers={"retriever": breaker},
        timeout_s=TIMEOUT_S,
    )
    try:
        yield Mesh(service, context, breaker)
    finally:
        await channel.close()
        await server.stop(None)


async def test_one_tenants_slow_searches_in_a_row_leave_rag_on_for_the_others(mesh: Mesh) -> None:
    """More heavy searches than the threshold, one after another, with nobody else searching: each
    times out (that turn goes without RAG), but the retriever answers a cheap search, so the breaker
    stays closed and the next tenant's search is served. It opened after the third before."""
    for _ in range(mesh.breaker.failure_threshold + 1):
        with pytest.raises(errors.DependencyUnavailable, match="DEADLINE_EXCEEDED"):
            await mesh.context.retrieve("heavy", "what is the leave policy?", HEAVY)
    assert mesh.breaker.state is BreakerState.CLOSED
    assert await mesh.context.retrieve("light", "vacation days?", LIGHT) == [CHUNK]


async def test_a_burst_of_slow_searches_beside_fast_ones_leaves_rag_on(mesh: Mesh) -> None:
    """Heavy searches at once while other tenants' fast ones are answered: the fast answers came back
    before the heavy ones timed out, so the timeouts arrived in a row, and opened the breaker."""

    async def light_traffic() -> int:
        served = 0
        for _ in range(4):
            served += len(await mesh.context.retrieve("light", "vacation days?", LIGHT))
            await asyncio.sleep(0.05)
        return served

    heavy = [
        mesh.context.retrieve("heavy", "leave policy?", HEAVY)
        for _ in range(2 * mesh.breaker.failure_threshold)
    ]
    results = await asyncio.gather(light_traffic(), *heavy, return_exceptions=True)
    assert results[0] == 4, results[0]
    assert all(isinstance(r, errors.DependencyUnavailable) for r in results[1:]), results[1:]
    assert mesh.breaker.state is BreakerState.CLOSED
    assert await mesh.context.retrieve("light", "vacation days?", LIGHT) == [CHUNK]


async def test_a_hung_retriever_still_opens_the_breaker(mesh: Mesh) -> None:
    """Nothing is answered, cheap searches included: after the threshold the breaker opens and the
    next search fails at once without reaching the retriever."""
    mesh.retriever.hung = True
    for _ in range(mesh.breaker.failure_threshold):
        with pytest.raises(errors.DependencyUnavailable, match="retriever unavailable"):
            await mesh.context.retrieve("light", "vacation days?", LIGHT)
    assert mesh.breaker.state is BreakerState.OPEN
    calls = mesh.retriever.calls
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(errors.DependencyUnavailable, match="circuit open"):
        await mesh.context.retrieve("light", "vacation days?", LIGHT)
    assert loop.time() - started < TIMEOUT_S / 2
    assert mesh.retriever.calls == calls


async def test_a_dead_retriever_still_opens_the_breaker() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # nothing listens on port 1
    breaker = CircuitBreaker("retriever", failure_threshold=2)
    context = ConversationContext(
        None,
        retriever_pb2_grpc.RetrieverStub(channel),  # type: ignore[arg-type]
        breakers={"retriever": breaker},
        timeout_s=TIMEOUT_S,
    )
    try:
        for _ in range(2):
            with pytest.raises(errors.DependencyUnavailable, match="retriever unavailable"):
                await context.retrieve("light", "q", LIGHT)
        assert breaker.state is BreakerState.OPEN
    finally:
        await channel.close()


async def test_a_slow_half_open_probe_does_not_keep_rag_off_once_the_retriever_answers(mesh: Mesh) -> None:
    """After a real outage, the first search let through may be a heavy one: its timeout says nothing
    about the retriever while cheap searches are answered, so the breaker closes instead of reopening
    for another reset period (which one heavy tenant could otherwise repeat forever)."""
    mesh.retriever.hung = True
    for _ in range(mesh.breaker.failure_threshold):
        with pytest.raises(errors.DependencyUnavailable):
            await mesh.context.retrieve("light", "vacation days?", LIGHT)
    assert mesh.breaker.state is BreakerState.OPEN
    mesh.retriever.hung = False
    await asyncio.sleep(mesh.breaker.reset_timeout_s)
    assert mesh.breaker.state is BreakerState.HALF_OPEN
    with pytest.raises(errors.DependencyUnavailable, match="DEADLINE_EXCEEDED"):
        await mesh.context.retrieve("heavy", "leave policy?", HEAVY)
    assert mesh.breaker.state is BreakerState.CLOSED
    assert await mesh.context.retrieve("light", "vacation days?", LIGHT) == [CHUNK]
