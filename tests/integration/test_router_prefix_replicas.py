"""Prefix-aware placement over three real replicas (SmolLM2 on CPU, small KV caches) and two
router instances (``--policy prefix --tokenizer``), each following every replica's KV events:
a shared ~1,000-token system prompt is served where it is cached, both routers place a request
alike, and a restarted replica's emptied entry sends its prefix elsewhere."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from services.gen.llmmesh.v1 import common_pb2, router_pb2
from tests.support.processes import ServiceProcess
from tests.support.router_mesh import router_process, router_stub

# Five processes (three real replicas, two routers): ~90 s on an idle 2-vCPU VM, so behind -m full;
# test_router_kv_events.py covers the events, restart and resync with one replica in make test.
pytestmark = [pytest.mark.timeout(300), pytest.mark.full]

# ≈ 1,000 tokens with SmolLM2's tokenizer and chat template: one group's shared system prompt.
WORDS = [
    "refund",
    "shipping",
    "invoice",
    "warranty",
    "delivery",
    "exchange",
    "payment",
    "address",
    "ticket",
    "review",
]
BLOCK = 16
TOKENIZER_READY = "prefix hashes from the tokenizer"
BYPASS = router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS)


def system_prompt(group: str) -> str:
    return f"{group}: " + " ".join(WORDS[(i * 7 + len(group)) % len(WORDS)] for i in range(990))


def replica(model: Path, port: int = 0) -> ServiceProcess:
    # 200 blocks of 16: about three such prompts per replica, and three replicas fit in this box.
    flags = ["--model", str(model), "--device", "cpu", "--dtype", "float32"]
    flags += ["--kv-blocks", "200", "--block-size", str(BLOCK), "--port", str(port)]
    return ServiceProcess("services.inference", flags)


@pytest.fixture(scope="module")
def mesh(model_path: Path) -> Iterator[tuple[list[ServiceProcess], list[ServiceProcess]]]:
    replicas = [replica(model_path) for _ in range(3)]
    routers: list[ServiceProcess] = []
    try:
        for r in replicas:
            r.start(timeout=240, wait_serving=False)
        for r in replicas:
            r.wait_serving(240)
        flags = ("--policy", "prefix", "--tokenizer", str(model_path))
        routers = [router_process(replicas, *flags).start() for _ in range(2)]
        for router in routers:
            wait_for(partial(events_live, router))
            # The tokenizer loads in the background; until then prompts are placed unhashed.
            wait_for(partial(tokenizer_loaded, router), timeout_s=180)
        yield replicas, routers
    finally:
        for process in [*routers, *replicas]:
            process.stop()


def ask(router: ServiceProcess, group: str, question: str) -> router_pb2.TurnEnd:
    request = router_pb2.ChatRequest(
        messages=[
            common_pb2.ChatMessage(role="system", content=system_prompt(group)),
            common_pb2.ChatMessage(role="user", content=question),
        ],
        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0),
        cache=BYPASS,
    )
    return router_stub(router).Complete(request, timeout=120).end


def statuses(router: ServiceProcess) -> dict[str, router_pb2.ReplicaStatus]:
    listed = router_stub(router).ListReplicas(router_pb2.ListReplicasRequest(), timeout=5).replicas
    return {s.address: s for s in listed}


def tokenizer_loaded(router: ServiceProcess) -> bool:
    return TOKENIZER_READY in router.output()


def events_live(router: ServiceProcess, address: str = "") -> bool:
    """The router follows ``address``'s KV events (every replica's, without one)."""
    listed = statuses(router)
    return all(s.kv_events for a, s in listed.items() if not address or a == address)


def wait_for(what: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def holds_prompt(router: ServiceProcess, address: str, min_blocks: int = 55) -> bool:
    """The router's index holds at least ``min_blocks`` blocks for ``address`` (a ~1,000-token prompt is ~62)."""
    return statuses(router).get(address, router_pb2.ReplicaStatus()).indexed_blocks >= min_blocks


def test_the_shared_prompt_goes_where_it_is_cached_and_is_served_from_the_cache(
    mesh: tuple[list[ServiceProcess], list[ServiceProcess]],
) -> None:
    _, (router, _) = mesh
    first = ask(router, "bookshop", "Can I return an opened book?")
    assert first.usage.prompt_tokens >= 900
    wait_for(lambda: holds_prompt(router, first.replica))
    for question in ("How long does delivery take?", "Is there a member discount?"):
        end = ask(router, "bookshop", question)
        assert end.replica == first.replica
        # Everything but the last partial block and the new question comes from the cache.
        assert end.usage.cached_prompt_tokens >= end.usage.prompt_tokens - 2 * BLOCK - 16
        assert end.usage.cached_prompt_tokens >= 0.9 * end.usage.prompt_tokens


def test_two_routers_fed_by_the_same_replicas_place_a_request_identically(
    mesh: tuple[list[ServiceProcess], list[ServiceProcess]],
) -> None:
    _, (router_a, router_b) = mesh
    warm = ask(router_a, "garden", "Do you sell seeds?")
    # Router B never sent this prompt anywhere: only the KV events tell it where it is.
    wait_for(lambda: holds_prompt(router_b, warm.replica))
    on_b = ask(router_b, "garden", "When do tulips ship?")
    on_a = ask(router_a, "garden", "When do tulips ship?")
    assert on_b.replica == on_a.replica == warm.replica
    assert on_b.usage.cached_prompt_tokens >= 0.9 * on_b.usage.prompt_tokens


def test_a_restarted_replica_loses_its_entry_and_its_prefix_is_served_elsewhere(
    mesh: tuple[list[ServiceProcess], list[ServiceProcess]], model_path: Path
) -> None:
    replicas, (router, other) = mesh
    held = ask(router, "hardware", "Do you cut keys?")
    (holder,) = [r for r in replicas if r.address == held.replica]
    port = holder.port
    assert port is not None
    holder.kill()
    wait_for(lambda: not statuses(router)[held.replica].kv_events)
    assert statuses(router)[held.replica].indexed_blocks == 0
    # Down, it is not chosen: another replica prefills the prompt and now holds it.
    moved = ask(router, "hardware", "Do you sell paint?")
    assert moved.replica != held.replica
    restarted = replica(model_path, port).start(timeout=240)
    replicas[replicas.index(holder)] = restarted  # the fixture stops the new process
    for r in (router, other):
        wait_for(partial(events_live, r, held.replica))
        assert statuses(r)[held.replica].indexed_blocks == 0  # the resync's snapshot is empty
    # Back and idle, it still holds nothing of the prompt: placements stay where the prefix is.
    for r in (router, other):
        end = ask(r, "hardware", "Are you open on Sunday?")
        assert end.replica == moved.replica
        assert end.usage.cached_prompt_tokens >= 0.9 * end.usage.prompt_tokens
