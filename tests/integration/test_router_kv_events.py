"""KV events end to end: one real replica (SmolLM2 on CPU), a router that hashes prompts with the
model's tokenizer and follows the replica's WatchKvEvents stream into its prefix index."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, router_pb2
from services.router.placement.prompt_hashes import PromptHasher, load_tokenizer
from tests.support.processes import ServiceProcess
from tests.support.router_mesh import router_process, router_stub

pytestmark = pytest.mark.timeout(240)

SYSTEM = "You are a terse assistant for an online bookshop. " * 12  # ≈ 130 tokens: several blocks
BYPASS = router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS)


def replica(model: Path, port: int = 0) -> ServiceProcess:
    return ServiceProcess(
        "services.inference", ["--model", str(model), "--device", "cpu", "--port", str(port)]
    )


@pytest.fixture(scope="module")
def hasher(model_path: Path) -> PromptHasher:
    return PromptHasher(load_tokenizer(str(model_path)))


@pytest.fixture(scope="module")
def mesh(model_path: Path) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    inference = replica(model_path).start(timeout=240)
    router = router_process([inference], "--policy", "prefix", "--tokenizer", str(model_path)).start()
    try:
        yield inference, router
    finally:
        router.stop()
        inference.stop()


def messages(question: str) -> list[common_pb2.ChatMessage]:
    return [
        common_pb2.ChatMessage(role="system", content=SYSTEM),
        common_pb2.ChatMessage(role="user", content=question),
    ]


def ask(router: ServiceProcess, question: str) -> None:
    request = router_pb2.ChatRequest(
        messages=messages(question),
        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0),
        cache=BYPASS,
    )
    router_stub(router).Complete(request, timeout=60)


def status(router: ServiceProcess) -> router_pb2.ReplicaStatus:
    (only,) = router_stub(router).ListReplicas(router_pb2.ListReplicasRequest(), timeout=5).replicas
    return only


def wait_for(what: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def replica_snapshot(inference: ServiceProcess) -> inference_pb2.KvSnapshot:
    with grpc.insecure_channel(inference.address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).WatchKvEvents(
            inference_pb2.WatchKvEventsRequest(), timeout=5
        )
        first = next(iter(call))
        call.cancel()
    return first.snapshot


def test_after_a_chat_request_the_routers_index_holds_the_prompts_blocks(
    mesh: tuple[ServiceProcess, ServiceProcess], hasher: PromptHasher
) -> None:
    inference, router = mesh
    wait_for(lambda: status(router).kv_events)
    question = "Do you ship to Norway?"
    block_size, prompt_hashes = hasher.hashes(inference_pb2.GenerateStart(messages=messages(question)), 16)
    assert len(prompt_hashes) >= 8
    ask(router, question)
    # The replica's own cache holds exactly the chain the router computes for the request…
    snapshot = replica_snapshot(inference)
    assert snapshot.block_size == block_size
    assert set(prompt_hashes) <= set(snapshot.block_hashes)
    # …and the router's index for the replica follows it through the events.
    wait_for(lambda: status(router).indexed_blocks == len(replica_snapshot(inference).block_hashes))
    assert status(router).indexed_blocks >= len(prompt_hashes)


def test_a_replica_restart_empties_its_entry_then_events_refill_it(
    mesh: tuple[ServiceProcess, ServiceProcess], hasher: PromptHasher, model_path: Path
) -> None:
    inference, router = mesh
    ask(router, "Is there a store in Oslo?")
    wait_for(lambda: status(router).indexed_blocks > 0)
    before = replica_snapshot(inference).incarnation
    port = inference.port
    assert port is not None
    inference.kill()
    wait_for(lambda: not status(router).kv_events and status(router).indexed_blocks == 0)
    restarted = replica(model_path, port).start(timeout=240)
    try:
        wait_for(lambda: status(router).kv_events)
        assert replica_snapshot(restarted).incarnation != before
        ask(router, "Is there a store in Oslo?")
        start = inference_pb2.GenerateStart(messages=messages("Is there a store in Oslo?"))
        _, chain = hasher.hashes(start, 16)
        assert set(chain) <= set(replica_snapshot(restarted).block_hashes)
        wait_for(lambda: status(router).indexed_blocks >= len(chain))
    finally:
        restarted.stop()
