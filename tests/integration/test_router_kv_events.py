"""KV events end to end: one real replica (SmolLM2 on CPU), a router that hashes prompts with the
model's tokenizer and follows the replica's WatchKvEvents stream into its prefix index."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, router_pb2
from services.router.admission.keys import add_key
from services.router.placement.cache_scope import TENANT, generation_salt
from services.router.placement.prompt_hashes import PromptHasher, load_tokenizer
from tests.support.processes import ServiceProcess
from tests.support.router_mesh import router_process, router_stub

pytestmark = pytest.mark.timeout(240)

SYSTEM = "You are a terse assistant for an online bookshop. " * 12  # ≈ 130 tokens: several blocks
BYPASS = router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS)
# What an open router (no keys file) salts every generation with: its one tenant's scope.
OPEN_SALT = generation_salt(TENANT, "default", "")


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


def messages(question: str, system: str = SYSTEM) -> list[common_pb2.ChatMessage]:
    return [
        common_pb2.ChatMessage(role="system", content=system),
        common_pb2.ChatMessage(role="user", content=question),
    ]


def ask(
    router: ServiceProcess, question: str, cache_salt: str = "", key: str = "", system: str = SYSTEM
) -> common_pb2.Usage:
    request = router_pb2.ChatRequest(
        messages=messages(question, system),
        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0),
        cache=BYPASS,
        cache_salt=cache_salt,
    )
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    return router_stub(router).Complete(request, timeout=60, metadata=metadata).end.usage


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
    start = inference_pb2.GenerateStart(messages=messages(question), cache_salt=OPEN_SALT)
    block_size, prompt_hashes = hasher.hashes(start, 16)
    assert len(prompt_hashes) >= 8
    ask(router, question)
    # The replica's own cache holds exactly the chain the router computes for the request…
    snapshot = replica_snapshot(inference)
    assert snapshot.block_size == block_size
    assert set(prompt_hashes) <= set(snapshot.block_hashes)
    # …and the router's index for the replica follows it through the events.
    wait_for(lambda: status(router).indexed_blocks == len(replica_snapshot(inference).block_hashes))
    assert status(router).indexed_blocks >= len(prompt_hashes)


def test_a_client_cache_salt_shares_cached_blocks_only_with_its_own_salt(
    mesh: tuple[ServiceProcess, ServiceProcess], hasher: PromptHasher
) -> None:
    """vLLM's cache_salt through the router: a prompt salted "alice" is cached for "alice" alone,
    under the hashes the router computes for that salt (so placement still finds it)."""
    inference, router = mesh
    wait_for(lambda: status(router).kv_events)
    system = "You answer questions about a private tax dossier, number 7731. " * 10
    first = ask(router, "What is due in March?", cache_salt="alice", system=system)
    assert first.cached_prompt_tokens == 0
    again = ask(router, "What is due in April?", cache_salt="alice", system=system)
    assert again.cached_prompt_tokens >= 96  # the system prompt's blocks, reused within the salt
    for other in ("bob", ""):  # another salt, or none, finds nothing of alice's
        assert ask(router, "What is due in May?", cache_salt=other, system=system).cached_prompt_tokens == 0
    # The replica's cache holds the chain the router computes for alice's salt.
    salted = generation_salt(TENANT, "default", "alice")
    start = inference_pb2.GenerateStart(messages=messages("What is due in April?", system), cache_salt=salted)
    _, chain = hasher.hashes(start, 16)
    assert set(chain) <= set(replica_snapshot(inference).block_hashes)


def test_tenants_never_reuse_each_others_cached_prompt_unless_the_scope_is_shared(
    mesh: tuple[ServiceProcess, ServiceProcess], tmp_path: Path
) -> None:
    """A cached prefix answers its first token sooner, so a tenant that could reuse another's
    cached blocks could time its way to that tenant's prompts. By default each tenant's blocks
    are its own; --prefix-cache-scope shared gives back the reuse across tenants."""
    inference, _ = mesh
    keys_file = tmp_path / "keys.yaml"
    acme, _ = add_key(keys_file, "acme")
    globex, _ = add_key(keys_file, "globex")
    for scope, globex_reuses in (("tenant", False), ("shared", True)):
        router = router_process(
            [inference], "--api-keys-file", str(keys_file), "--prefix-cache-scope", scope
        ).start()
        try:
            system = f"Internal memo for the {scope} board: merger codename Heron, do not share. " * 8
            assert ask(router, "Summarise.", key=acme, system=system).cached_prompt_tokens == 0
            assert ask(router, "Who wrote it?", key=acme, system=system).cached_prompt_tokens >= 80
            reused = ask(router, "Summarise.", key=globex, system=system).cached_prompt_tokens
            assert (reused >= 80) if globex_reuses else (reused == 0), (scope, reused)
        finally:
            router.stop()


# Last: it kills the module's replica (the tests above need it alive).
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
        start = inference_pb2.GenerateStart(
            messages=messages("Is there a store in Oslo?"), cache_salt=OPEN_SALT
        )
        _, chain = hasher.hashes(start, 16)
        assert set(chain) <= set(replica_snapshot(restarted).block_hashes)
        wait_for(lambda: status(router).indexed_blocks >= len(chain))
    finally:
        restarted.stop()
