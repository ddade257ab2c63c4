"""Usage is what the client received: after a cancel, after a failover, and from either cache.

Through a real router process over gRPC. The replicas are the synthetic token
source (deterministic tokens, usage counted like the engine's: resumed tokens
are not the replica's completion tokens): what is tested is the router's
counting. test_router_engine.py repeats cancel and failover-then-cache with
the real engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.gen.llmmesh.v1 import common_pb2, router_pb2
from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer
from tests.support.router_mesh import (
    expected_synthetic_ids,
    read_turn,
    router_process,
    router_stub,
    serving_replica,
    synthetic_replica,
    user_turn,
)

BYPASS = router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS)
# Tokens the client takes before it cancels.
CANCEL_AFTER = 10


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def mesh(redis: RedisServer) -> Iterator[tuple[ServiceProcess, list[ServiceProcess]]]:
    """Two replicas at 50 tokens/s: slow enough to cancel mid-answer."""
    replicas = [synthetic_replica("--tokens-per-second", "50") for _ in range(2)]
    router: ServiceProcess | None = None
    try:
        for r in replicas:
            r.start()
        router = router_process(replicas, "--redis-url", redis.url).start()
        yield router, replicas
    finally:
        for p in [router, *replicas]:
            if p is not None:
                p.stop()


def tokens_of(messages: list[router_pb2.ChatResponse]) -> int:
    return sum(len(m.delta.token_ids) for m in messages if m.HasField("delta"))


def test_a_chat_turn_cancelled_after_n_tokens_reports_them_and_the_replica_that_streamed_them(
    mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, _ = mesh
    stub = router_stub(router)
    enough = threading.Event()
    streamer: list[str | None] = []

    def client_messages() -> Iterator[router_pb2.ChatRequest]:
        yield user_turn("a long answer to cancel", 4000, request_id="usage-chat-cancel", cache=BYPASS)
        enough.wait(20)
        yield router_pb2.ChatRequest(cancel=True)

    received: list[router_pb2.ChatResponse] = []
    for response in stub.Chat(client_messages(), timeout=30):
        received.append(response)
        if not enough.is_set() and tokens_of(received) >= CANCEL_AFTER:
            streamer.append(serving_replica(stub))
            enough.set()
    end = received[-1].end
    assert end.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert end.usage.completion_tokens == tokens_of(received) >= CANCEL_AFTER
    assert streamer[0] is not None and end.replica == streamer[0]
    assert end.model == "synthetic"
    # The replay buffer keeps the same end: Resume tells the same numbers.
    replayed = read_turn(stub.Resume(router_pb2.ResumeRequest(request_id="usage-chat-cancel"), timeout=10))
    assert replayed.messages == received


def test_a_cancelled_chat_stream_is_resumed_with_the_tokens_streamed_and_their_replica(
    mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, _ = mesh
    stub = router_stub(router)
    request = user_turn("another long answer", 4000, request_id="usage-stream-cancel", cache=BYPASS)
    stream = stub.ChatStream(request, timeout=30)
    received: list[router_pb2.ChatResponse] = []
    while tokens_of(received) < CANCEL_AFTER:
        received.append(next(stream))
    streamed_by = serving_replica(stub)
    stream.cancel()
    replayed = read_turn(stub.Resume(router_pb2.ResumeRequest(request_id="usage-stream-cancel"), timeout=10))
    # What the router sent may be a message more than the client read before it cancelled.
    assert replayed.messages[: len(received)] == received
    assert replayed.end.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert replayed.end.usage.completion_tokens == len(replayed.token_ids) >= CANCEL_AFTER
    assert streamed_by is not None and replayed.end.replica == streamed_by


def test_a_task_cancelled_mid_answer_records_the_tokens_it_streamed(
    mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, _ = mesh
    stub = router_stub(router)
    turn = user_turn("a long task to cancel", 4000, cache=BYPASS)
    task = stub.SubmitTask(router_pb2.SubmitTaskRequest(request=turn), timeout=10)
    # What the watcher saw: the first event's text so far (a task may have started before
    # the watch did), then every delta's tokens (the synthetic source writes token t as " t<t>").
    seen = ""
    streamed_by: str | None = None
    last = task
    for event in stub.WatchTask(router_pb2.WatchTaskRequest(task_id=task.task_id), timeout=30):
        if event.HasField("delta"):
            seen += "".join(f" t{t}" for t in event.delta.token_ids)
            if streamed_by is None and len(seen.split()) >= CANCEL_AFTER:
                streamed_by = serving_replica(stub)
                stub.CancelTask(router_pb2.CancelTaskRequest(task_id=task.task_id), timeout=10)
        else:
            if last is task:
                seen = event.task.text
            last = event.task
    assert last.state == router_pb2.TASK_STATE_CANCELLED
    final = stub.GetTask(router_pb2.GetTaskRequest(task_id=task.task_id), timeout=10)
    assert final.end.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert final.end.usage.completion_tokens == len(seen.split()) >= CANCEL_AFTER
    assert streamed_by is not None and final.end.replica == streamed_by
    assert final.text == seen  # the same tokens as the watcher saw, none lost, none repeated


def test_a_cached_answer_replays_the_usage_of_the_original(
    mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, _ = mesh
    stub = router_stub(router)
    request = user_turn("cache my usage", 12)
    first = stub.Complete(request, timeout=10)
    second = stub.Complete(request, timeout=10)
    assert first.end.cache_layer == router_pb2.CACHE_LAYER_UNSPECIFIED
    assert second.end.cache_layer == router_pb2.CACHE_LAYER_EXACT
    assert first.end.usage.completion_tokens == len(first.token_ids) == 12
    assert first.end.usage.prompt_tokens > 0
    assert second.end.usage == first.end.usage


def test_a_failed_over_answer_counts_every_replicas_part_and_the_cache_replays_it_whole(
    redis: RedisServer,
) -> None:
    replicas = [synthetic_replica("--tokens-per-second", "40") for _ in range(3)]
    router: ServiceProcess | None = None
    try:
        for r in replicas:
            r.start()
        router = router_process(replicas, "--redis-url", redis.url).start()
        stub = router_stub(router)
        request = user_turn("survive a crash and count it all", 40)
        stream = stub.ChatStream(request, timeout=30)
        messages = [next(stream) for _ in range(5)]
        victim = serving_replica(stub)
        assert victim is not None
        next(r for r in replicas if r.address == victim).kill()
        messages += list(stream)
        answer = read_turn(messages)
        assert answer.end.failovers == 1
        assert answer.token_ids == expected_synthetic_ids(request)
        # Every token the client got, whichever replica made it; the prompt once.
        assert answer.end.usage.completion_tokens == len(answer.token_ids) == 40
        uncached = copy_with_cache(request, BYPASS)
        same_prompt = stub.Complete(uncached, timeout=10).end.usage
        assert answer.end.usage.prompt_tokens == same_prompt.prompt_tokens > 0

        # The cache keeps the whole answer's usage, not the part after the failover.
        hit = stub.Complete(request, timeout=10)
        assert hit.end.cache_layer == router_pb2.CACHE_LAYER_EXACT
        assert list(hit.token_ids) == answer.token_ids
        assert hit.end.usage == answer.end.usage
    finally:
        for p in [router, *replicas]:
            if p is not None:
                p.stop()


def copy_with_cache(request: router_pb2.ChatRequest, cache: router_pb2.CachePolicy) -> router_pb2.ChatRequest:
    copy = router_pb2.ChatRequest()
    copy.CopyFrom(request)
    copy.cache.CopyFrom(cache)
    return copy


def test_a_semantic_hit_replays_the_usage_of_the_original_in_its_end_resume_and_task(tmp_path: Path) -> None:
    """A near-duplicate prompt answered from the retriever's semantic cache tells the original's usage.

    A real retriever (Milvus Lite, the real embedding model) holds the semantic
    cache; the replica is the synthetic token source, since what is tested is
    the router's and the retriever's bookkeeping, not the model's counting.
    """
    # Its own Redis: the module's router would otherwise pick up this test's task from the shared queue.
    redis = RedisServer(tmp_path / "redis").start()
    replica = synthetic_replica("--cached-prompt-tokens", "3")
    retriever = ServiceProcess("services.retriever", ["--milvus-uri", str(tmp_path / "milvus.db")])
    router: ServiceProcess | None = None
    semantic = router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_DEFAULT, semantic=True)
    try:
        replica.start()
        retriever.start(timeout=300)
        # No refreshes: a refresh (5 % of hits by default) answers fresh on purpose, and the
        # synthetic source's answer to another wording differs, which would retire the entry.
        # What is tested here is the usage bookkeeping, not the confidence learning.
        router = router_process(
            [replica],
            "--redis-url",
            redis.url,
            "--retriever-addr",
            retriever.address,
            "--semantic-cache-refresh-rate",
            "0",
        ).start()
        stub = router_stub(router)
        original = stub.Complete(
            user_turn("How many moons does the planet Mars have?", 12, cache=semantic), timeout=60
        )
        assert original.end.cache_layer == router_pb2.CACHE_LAYER_UNSPECIFIED
        assert original.end.usage.completion_tokens == len(original.token_ids) == 12
        assert original.end.usage.prompt_tokens > original.end.usage.cached_prompt_tokens == 3

        # Another wording: the exact cache misses, the semantic one answers with the original's usage.
        again = user_turn(
            "How many moons has the planet Mars?", 12, cache=semantic, request_id="usage-semantic"
        )
        hit = read_turn(stub.ChatStream(again, timeout=60))
        assert hit.end.cache_layer == router_pb2.CACHE_LAYER_SEMANTIC
        assert hit.text == original.text
        assert hit.end.usage == original.end.usage
        assert hit.end.finish_reason == original.end.finish_reason == common_pb2.FINISH_REASON_LENGTH
        replayed = read_turn(stub.Resume(router_pb2.ResumeRequest(request_id="usage-semantic"), timeout=10))
        assert replayed.messages == hit.messages

        again.request_id = ""
        task = stub.SubmitTask(router_pb2.SubmitTaskRequest(request=again), timeout=10)
        for _ in stub.WatchTask(router_pb2.WatchTaskRequest(task_id=task.task_id), timeout=60):
            pass
        record = stub.GetTask(router_pb2.GetTaskRequest(task_id=task.task_id), timeout=10)
        assert record.end.cache_layer == router_pb2.CACHE_LAYER_SEMANTIC
        assert record.end.usage == original.end.usage
        assert record.text == original.text
    finally:
        for p in [router, retriever, replica]:
            if p is not None:
                p.stop()
        redis.kill()
