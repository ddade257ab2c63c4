"""The router over 3 real inference replicas (SmolLM2) with the session service, the retriever and Redis.

Generations stay short (≤ 24 tokens): the CI machine runs them on CPU.
"""

from __future__ import annotations

import itertools
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common.metadata import TENANT_KEY
from services.gen.llmmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    retriever_pb2,
    router_pb2,
    session_pb2,
    session_pb2_grpc,
)
from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer
from tests.support.router_mesh import (
    read_turn,
    router_stub,
    serving_replica,
    user_turn,
    wait_until_idle,
)
from tests.support.shared_replica import holds_nothing, load

BYPASS = router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS)


class Mesh:
    def __init__(
        self, router: ServiceProcess, replicas: list[ServiceProcess], session: ServiceProcess
    ) -> None:
        self.router = router
        self.replicas = replicas
        self.session = session
        self.stub = router_stub(router)

    def engine_tokens(self) -> float:
        """Prompt + generated tokens every replica has processed, from their metrics."""
        total = 0.0
        for replica in self.replicas:
            if replica.proc is None or replica.proc.poll() is not None:
                continue
            with urllib.request.urlopen(
                f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=5
            ) as page:
                for line in page.read().decode().splitlines():
                    if line.startswith(("llmmesh_generation_tokens_total ", "llmmesh_prompt_tokens_total ")):
                        total += float(line.split()[1])
        return total


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[Mesh]:
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()
    milvus = tmp_path_factory.mktemp("milvus") / "milvus.db"
    replicas = [
        ServiceProcess(
            "services.inference",
            ["--model", str(model_path), "--device", "cpu", "--metrics-port", "0", "--max-num-seqs", "8"],
        )
        for _ in range(3)
    ]
    session = ServiceProcess("services.session", ["--redis-url", redis.url])
    retriever = ServiceProcess("services.retriever", ["--milvus-uri", str(milvus)])
    processes = [*replicas, session, retriever]
    router: ServiceProcess | None = None
    try:
        # Start everything, then wait: the model loads overlap.
        for p in processes:
            p.start(wait_serving=False)
        for p in processes:
            p.wait_serving(240)
        router = ServiceProcess(
            "services.router",
            [
                "--replicas",
                ",".join(r.address for r in replicas),
                "--session-addr",
                session.address,
                "--retriever-addr",
                retriever.address,
                "--redis-url",
                redis.url,
                "--health-interval-s",
                "0.5",
            ],
        ).start()
        yield Mesh(router, replicas, session)
    finally:
        for p in [router, *processes]:
            if p is not None:
                p.stop()
        redis.kill()


def test_a_session_stays_on_one_replica_for_20_turns_and_carries_its_history(mesh: Mesh) -> None:
    homes, prompt_sizes, versions = set(), [], []
    for turn in range(20):
        answer = read_turn(
            mesh.stub.ChatStream(user_turn(f"Say a word, number {turn}.", 2, session_id="engine-s1"))
        )
        end = answer.end
        assert not end.degraded, end.degraded_reasons
        homes.add(end.replica)
        prompt_sizes.append(end.usage.prompt_tokens)
        versions.append(end.session_version)
    assert len(homes) == 1
    # Every turn's prompt holds the whole conversation so far, so it only grows.
    assert all(b > a for a, b in itertools.pairwise(prompt_sizes))
    assert all(b > a for a, b in itertools.pairwise(versions))
    # The warm replica reuses the session's prefix from its cache.
    last = read_turn(mesh.stub.ChatStream(user_turn("And one more.", 1, session_id="engine-s1"))).end
    assert last.replica in homes and last.usage.cached_prompt_tokens > 0


def test_a_retried_turn_sees_the_history_its_first_try_saw_and_is_saved_once(mesh: Mesh) -> None:
    """A client that lost the end of a turn (its connection broke) sends it again under its request
    id: the retry is not shown its own first exchange, and the session holds the exchange once."""
    session = "engine-retry"
    opening = read_turn(
        mesh.stub.ChatStream(user_turn("Hi, I am Ada.", 4, session_id=session, cache=BYPASS))
    ).end
    question = user_turn("What is my name?", 4, session_id=session, cache=BYPASS, request_id="ask-name-1")
    first = read_turn(mesh.stub.ChatStream(question))
    retry = read_turn(mesh.stub.ChatStream(question))
    assert not first.end.degraded and not retry.end.degraded, (first.end, retry.end)
    assert (opening.session_version, first.end.session_version, retry.end.session_version) == (1, 2, 2)
    # The same prompt as the first try (its history held only the opening), so the same greedy answer.
    assert retry.end.usage.prompt_tokens == first.end.usage.prompt_tokens > opening.usage.prompt_tokens
    assert retry.token_ids == first.token_ids
    # The session holds the question and its first answer once (the open router's tenant).
    with grpc.insecure_channel(mesh.session.address) as channel:
        stored = session_pb2_grpc.SessionStub(channel).GetSession(
            session_pb2.GetSessionRequest(session_id=session), metadata=((TENANT_KEY, "default"),), timeout=5
        )
    assert [(t.role, t.content) for t in stored.turns][2:] == [
        ("user", "What is my name?"),
        ("assistant", first.text),
    ]
    assert [t.request_id for t in stored.turns][2:] == ["ask-name-1"] * 2
    # Another question under that id is another turn: refused before any answer, not answered
    # from the history before the id's exchange and then silently not stored.
    other = user_turn("Where do I live?", 4, session_id=session, cache=BYPASS, request_id="ask-name-1")
    with pytest.raises(grpc.RpcError) as refused:
        list(mesh.stub.ChatStream(other))
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS  # type: ignore[attr-defined]
    assert "request_id: 'ask-name-1' already named another turn" in refused.value.details()  # type: ignore[attr-defined]


def test_rag_puts_retrieved_chunks_into_the_prompt_and_cites_them(mesh: Mesh) -> None:
    text = (
        "The Zorblax reactor on Kepler station runs on liquid helium-3. "
        "Its chief engineer is Mara Voss, who designed the cooling loop in 2091."
    )
    parts = [
        retriever_pb2.IngestRequest(
            header=retriever_pb2.DocumentHeader(
                document_id="zorblax", title="Zorblax manual", mime_type="text/plain"
            )
        ),
        retriever_pb2.IngestRequest(data=text.encode()),
    ]
    summary = mesh.stub.IngestDocument(iter(parts), timeout=60)
    assert summary.chunks >= 1
    plain = user_turn("Who is the chief engineer of the Zorblax reactor?", 8, cache=BYPASS)
    with_rag = user_turn(
        "Who is the chief engineer of the Zorblax reactor?",
        8,
        rag=router_pb2.RagOptions(enabled=True, top_k=2),
        cache=BYPASS,
    )
    without = mesh.stub.Complete(plain, timeout=60).end
    answer = mesh.stub.Complete(with_rag, timeout=60)
    assert not answer.end.degraded, answer.end.degraded_reasons
    assert [c.document_id for c in answer.end.citations][:1] == ["zorblax"]
    assert "Mara Voss" in answer.end.citations[0].snippet
    assert answer.end.usage.prompt_tokens > without.usage.prompt_tokens + 20  # the chunk is in the prompt


def test_repeated_deterministic_request_is_a_cache_hit_with_zero_engine_work(mesh: Mesh) -> None:
    request = user_turn("Name a primary colour.", 6)
    first = mesh.stub.Complete(request, timeout=60)
    before = mesh.engine_tokens()
    second = mesh.stub.Complete(request, timeout=60)
    assert mesh.engine_tokens() == before
    assert second.end.cache_layer == router_pb2.CACHE_LAYER_EXACT
    assert second.text == first.text and list(second.token_ids) == list(first.token_ids)


def test_client_deadline_and_cancel_reach_the_replica(mesh: Mesh) -> None:
    long = user_turn("Count from one to one hundred.", 200, ignore_eos=True, cache=BYPASS)
    with pytest.raises(grpc.RpcError) as caught:
        mesh.stub.Complete(long, timeout=0.4)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until_idle(mesh.replicas, timeout=5.0)

    stream = mesh.stub.ChatStream(long, timeout=60)
    got = [next(stream) for _ in range(3)]
    assert all(m.HasField("delta") for m in got)
    stream.cancel()
    assert wait_until_idle(mesh.replicas, timeout=5.0) < 5.0


def test_a_chat_turn_cancelled_mid_answer_reports_the_tokens_streamed_and_their_replica(mesh: Mesh) -> None:
    enough = threading.Event()
    streamer: list[str | None] = []

    def client_messages() -> Iterator[router_pb2.ChatRequest]:
        yield user_turn("Count from one to one hundred.", 200, ignore_eos=True, cache=BYPASS)
        enough.wait(60)
        yield router_pb2.ChatRequest(cancel=True)

    received: list[router_pb2.ChatResponse] = []
    for response in mesh.stub.Chat(client_messages(), timeout=60):
        received.append(response)
        tokens = sum(len(m.delta.token_ids) for m in received if m.HasField("delta"))
        if not enough.is_set() and tokens >= 5:
            streamer.append(serving_replica(mesh.stub))
            enough.set()
    end = received[-1].end
    assert end.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert end.usage.completion_tokens == len(read_turn(received[:-1]).token_ids) >= 5
    assert streamer[0] is not None and end.replica == streamer[0]
    wait_until_idle(mesh.replicas, timeout=5.0)


def test_a_lost_replicas_session_moves_to_a_prewarmed_successor(mesh: Mesh) -> None:
    """Kills the session's replica; the next turn finds its history already in the new replica's cache."""
    session = "engine-prewarm"
    topics = ["the history of lighthouses", "how tides work", "why the sea is salty"]
    homes = set()
    for topic in topics:
        text = f"Please explain {topic} in simple words for a curious child who likes boats."
        homes.add(
            read_turn(mesh.stub.ChatStream(user_turn(text, 4, session_id=session, cache=BYPASS))).end.replica
        )
    assert len(homes) == 1
    home = homes.pop()
    survivors = [r for r in mesh.replicas if r.address != home and r.alive()]
    cached_before = {r.address: load(r).kv_blocks_cached for r in survivors}
    next(r for r in mesh.replicas if r.address == home).kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pool = mesh.stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5).replicas
        if any(r.address == home and r.health == router_pb2.REPLICA_HEALTH_NOT_SERVING for r in pool):
            break
        time.sleep(0.1)

    def prewarmed() -> bool:
        # The move ends with a one-token generation of the history on the successor: done once
        # a survivor caches more prefix blocks than before and runs nothing.
        loads = [(r.address, load(r)) for r in survivors]
        return any(
            report.kv_blocks_cached > cached_before[address] and holds_nothing(report)
            for address, report in loads
        )

    # Every session of the lost replica moves (other tests' sessions too), and the move logs once
    # each pre-warm has ended: a survivor warmed with another session's history alone is not this
    # session's move being done.
    deadline = time.monotonic() + 30
    while not (prewarmed() and any(f"sessions off {home}" in line for line in mesh.router.lines)):
        assert time.monotonic() < deadline, "no survivor was pre-warmed with the session 30 s after the kill"
        time.sleep(0.1)
    end = read_turn(mesh.stub.ChatStream(user_turn("Thanks!", 2, session_id=session, cache=BYPASS))).end
    assert end.replica != home
    assert end.usage.prompt_tokens > 100
    # Everything but the new message (and the partial last KV block) came from the prefix cache.
    assert end.usage.cached_prompt_tokens >= end.usage.prompt_tokens - 40


def test_kill_9_mid_stream_gives_exactly_the_uninterrupted_greedy_tokens(mesh: Mesh) -> None:
    """Runs last in this module: it kills one of the replicas.

    The answer is cached after its failover; a hit replays the whole answer's usage. A stop
    string that never matches keeps the replica's last characters back until it is clear they do
    not begin it: those the victim held when it died come from its successor, so the text is the
    uninterrupted one too.
    """
    request = user_turn("Write a short poem about the sea.", 24, ignore_eos=True)
    request.sampling.stop.append("a stop string this poem will not write")
    start = inference_pb2.GenerateStart(messages=request.messages, sampling=request.sampling)
    alive = next(r for r in mesh.replicas if r.proc is not None and r.proc.poll() is None)
    with grpc.insecure_channel(alive.address) as channel:
        direct = list(
            inference_pb2_grpc.InferenceStub(channel).Generate(
                iter([inference_pb2.GenerateRequest(start=start)]), timeout=120
            )
        )
        reference = [t for r in direct if r.HasField("chunk") for t in r.chunk.token_ids]
        reference_text = "".join(r.chunk.text for r in direct if r.HasField("chunk"))
        prompt_tokens = direct[-1].finished.usage.prompt_tokens
    assert len(reference) == 24

    stream = mesh.stub.ChatStream(request, timeout=120)
    messages = [next(stream) for _ in range(4)]
    victim = serving_replica(mesh.stub)
    assert victim is not None
    killer = threading.Thread(target=next(r for r in mesh.replicas if r.address == victim).kill)
    killer.start()
    messages += list(stream)
    killer.join()
    answer = read_turn(messages)
    assert answer.token_ids == reference
    assert answer.text == reference_text
    assert answer.end.failovers == 1
    assert answer.end.replica != victim
    assert answer.end.finish_reason == common_pb2.FINISH_REASON_LENGTH
    # Both replicas' tokens, the prompt once (as the engine counts it).
    usage = answer.end.usage
    assert usage.completion_tokens == 24 and usage.prompt_tokens == prompt_tokens
    assert usage.cached_prompt_tokens <= usage.prompt_tokens
    hit = mesh.stub.Complete(request, timeout=60)
    assert hit.end.cache_layer == router_pb2.CACHE_LAYER_EXACT
    assert list(hit.token_ids) == reference
    assert hit.end.usage == usage
