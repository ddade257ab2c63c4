"""The router in front of synthetic token sources: relay, affinity, failover, deadlines, cancel, admission.

Replicas here are the synthetic token source (deterministic tokens, no model),
so these tests are fast; test_router_engine.py repeats the key ones with the
real engine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.admission.auth import hash_key
from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer
from tests.support.router_mesh import (
    expected_synthetic_ids,
    read_turn,
    router_process,
    router_stub,
    running_sequences,
    serving_replica,
    synthetic_replica,
    user_turn,
    wait_until_idle,
)

KEYS = {
    "alice": ("acme", {"requests_per_second": 0.5, "burst": 2}),
    "bob": ("globex", {}),
    "carol": ("acme", {}),
}


def bearer(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer key-of-{name}"),)


CAROL = bearer("carol")


@pytest.fixture(scope="module")
def redis_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    records = [
        {"id": name, "tenant": tenant, "sha256": hash_key(f"key-of-{name}"), **limits}
        for name, (tenant, limits) in KEYS.items()
    ]
    path.write_text(yaml.safe_dump({"keys": records}))
    return path


@pytest.fixture(scope="module")
def mesh(redis_module: RedisServer, keys_file: Path) -> Iterator[tuple[ServiceProcess, list[ServiceProcess]]]:
    replicas = [synthetic_replica("--tokens-per-second", "500") for _ in range(3)]
    router: ServiceProcess | None = None
    try:
        for r in replicas:
            r.start()
        router = router_process(
            replicas, "--redis-url", redis_module.url, "--api-keys-file", str(keys_file)
        ).start()
        yield router, replicas
    finally:
        for p in [router, *replicas]:
            if p is not None:
                p.stop()


@pytest.fixture(scope="module")
def slow_mesh() -> Iterator[tuple[ServiceProcess, list[ServiceProcess]]]:
    """Replicas that take 1.5 s to the first token, then 10 tokens/s: time to cancel mid-way."""
    replicas = [
        synthetic_replica("--ttft-ms", "1500", "--tokens-per-second", "10", "--log-requests")
        for _ in range(2)
    ]
    router: ServiceProcess | None = None
    try:
        for r in replicas:
            r.start()
        router = router_process(replicas).start()
        yield router, replicas
    finally:
        for p in [router, *replicas]:
            if p is not None:
                p.stop()


def test_stream_is_the_replicas_tokens_numbered_by_seq(
    mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, replicas = mesh
    request = user_turn("tell me a story", max_tokens=12)
    answer = read_turn(router_stub(router).ChatStream(request, metadata=CAROL, timeout=10))
    assert answer.token_ids == expected_synthetic_ids(request)
    assert [m.seq for m in answer.messages] == list(range(1, len(answer.messages) + 1))
    assert len({m.request_id for m in answer.messages}) == 1
    end = answer.end
    assert end.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert end.model == "synthetic"
    assert end.replica in {r.address for r in replicas}
    assert end.usage.completion_tokens == 12


def test_complete_returns_the_whole_answer(mesh: tuple[ServiceProcess, list[ServiceProcess]]) -> None:
    router, _ = mesh
    request = user_turn("one shot", max_tokens=5)
    response = router_stub(router).Complete(request, metadata=CAROL, timeout=10)
    assert list(response.token_ids) == expected_synthetic_ids(request)
    assert response.text.count(" t") == 5
    assert response.end.usage.completion_tokens == 5


def test_a_session_stays_on_one_replica_for_20_turns(
    mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, _ = mesh
    stub = router_stub(router)
    homes = set()
    for turn in range(20):
        answer = read_turn(
            stub.ChatStream(user_turn(f"turn {turn}", 2, session_id="s-affinity"), metadata=CAROL)
        )
        homes.add(answer.end.replica)
    assert len(homes) == 1
    # Other sessions spread over the pool rather than piling onto one replica.
    spread = {
        read_turn(stub.ChatStream(user_turn(f"hi {i}", 1, session_id=f"s-{i}"), metadata=CAROL)).end.replica
        for i in range(30)
    }
    assert len(spread) == 3


def test_chat_stream_runs_turns_in_order_on_one_connection(
    mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, _ = mesh
    turns = [user_turn("first", 3), user_turn("second", 4)]
    responses = list(router_stub(router).Chat(iter(turns), metadata=CAROL, timeout=10))
    ends = [r for r in responses if r.HasField("end")]
    assert len(ends) == 2
    first_id = responses[0].request_id
    first = [r for r in responses if r.request_id == first_id]
    assert [t for r in first if r.HasField("delta") for t in r.delta.token_ids] == expected_synthetic_ids(
        turns[0]
    )


@pytest.mark.parametrize(
    "unreadable",
    [b"\xff\xff\xff\xff", b"\x0a\x0c\x0a\x04user\x12\x04\xff\xfe\xfd\xfc"],  # garbage; content not UTF-8
    ids=["garbage", "not-utf8"],
)
def test_an_unreadable_chat_message_ends_the_stream_with_invalid_argument(
    mesh: tuple[ServiceProcess, list[ServiceProcess]], unreadable: bytes
) -> None:
    """The handler's reader died on it and the stream hung with no status."""
    router, _ = mesh
    with grpc.insecure_channel(router.address) as channel:
        chat = channel.stream_stream(
            "/llmmesh.v1.Router/Chat",
            request_serializer=lambda raw: raw,
            response_deserializer=router_pb2.ChatResponse.FromString,
        )
        got: list[router_pb2.ChatResponse] = []
        with pytest.raises(grpc.RpcError) as caught:
            for response in chat(
                iter([user_turn("first", 3).SerializeToString(), unreadable]), metadata=CAROL, timeout=10
            ):
                got.append(response)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert (caught.value.details() or "").startswith("request: not a ChatRequest")


def test_missing_or_wrong_key_is_unauthenticated(mesh: tuple[ServiceProcess, list[ServiceProcess]]) -> None:
    router, _ = mesh
    stub = router_stub(router)
    for metadata in [(), (("authorization", "Bearer nope"),)]:
        with pytest.raises(grpc.RpcError) as caught:
            stub.Complete(user_turn("hi", 1), metadata=metadata, timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_bursting_key_is_limited_while_another_key_is_not(
    mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, _ = mesh
    stub = router_stub(router)
    codes = []
    for _ in range(5):
        try:
            stub.Complete(user_turn("burst", 1), metadata=bearer("alice"), timeout=5)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
            assert "rate limit" in (exc.details() or "")
    assert codes[:2] == [grpc.StatusCode.OK, grpc.StatusCode.OK]  # the burst
    assert codes[2:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
    for _ in range(5):
        assert stub.Complete(
            user_turn("steady", 1), metadata=bearer("bob"), timeout=5
        ).end.usage.completion_tokens


def test_resume_replays_missing_messages_only_for_the_owning_tenant(
    mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, _ = mesh
    stub = router_stub(router)
    request = user_turn("resume me", 10, request_id="resume-test-1")
    original = read_turn(stub.ChatStream(request, metadata=CAROL, timeout=10))
    deadline = time.monotonic() + 5
    while True:  # the replay buffer is written off the hot path: give it a moment
        replayed = read_turn(
            stub.Resume(router_pb2.ResumeRequest(request_id="resume-test-1", last_seq=4), metadata=CAROL)
        )
        if (replayed.messages and replayed.messages[-1].HasField("end")) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [m.seq for m in replayed.messages] == list(range(5, len(original.messages) + 1))
    assert replayed.messages == original.messages[4:]
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Resume(router_pb2.ResumeRequest(request_id="resume-test-1"), metadata=bearer("bob")))
    # Another tenant's id is not theirs to know of (it was PERMISSION_DENIED, which said it exists).
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    # A request id is the tenant's own: bob's turn by the same id neither reads nor takes
    # carol's buffer (the first tenant to write an id owned it: bob's Resume replayed carol's
    # answer, and carol's was refused), and both run, each on its own engine id.
    bobs = read_turn(
        stub.ChatStream(user_turn("another story", 6, request_id="resume-test-1"), metadata=bearer("bob"))
    )
    assert bobs.end.finish_reason == common_pb2.FINISH_REASON_LENGTH
    deadline = time.monotonic() + 5
    while True:
        theirs = read_turn(
            stub.Resume(router_pb2.ResumeRequest(request_id="resume-test-1"), metadata=bearer("bob"))
        )
        if (theirs.messages and theirs.messages[-1].HasField("end")) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert theirs.messages == bobs.messages
    mine = read_turn(stub.Resume(router_pb2.ResumeRequest(request_id="resume-test-1"), metadata=CAROL))
    assert mine.messages == original.messages
    # A last_seq past any seq is refused, not read after the end marker for 120 s.
    with pytest.raises(grpc.RpcError) as caught:
        list(
            stub.Resume(router_pb2.ResumeRequest(request_id="resume-test-1", last_seq=2**63), metadata=CAROL)
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("last_seq:")


def test_repeated_deterministic_request_is_answered_from_the_exact_cache(
    mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, _ = mesh
    stub = router_stub(router)
    request = user_turn("cache me please", 6)
    first = stub.Complete(request, metadata=CAROL, timeout=10)
    second = stub.Complete(request, metadata=CAROL, timeout=10)
    assert first.end.cache_layer == router_pb2.CACHE_LAYER_UNSPECIFIED
    assert second.end.cache_layer == router_pb2.CACHE_LAYER_EXACT
    assert second.end.replica == ""  # no replica was asked
    assert list(second.token_ids) == list(first.token_ids) and second.text == first.text
    # Another tenant never sees acme's cached answer.
    assert (
        stub.Complete(request, metadata=bearer("bob"), timeout=10).end.cache_layer
        == router_pb2.CACHE_LAYER_UNSPECIFIED
    )
    bypass = user_turn("cache me please", 6, cache=router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS))
    assert (
        stub.Complete(bypass, metadata=CAROL, timeout=10).end.cache_layer
        == router_pb2.CACHE_LAYER_UNSPECIFIED
    )


def test_bad_input_names_the_field(mesh: tuple[ServiceProcess, list[ServiceProcess]]) -> None:
    router, _ = mesh
    stub = router_stub(router)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Complete(router_pb2.ChatRequest(), metadata=CAROL, timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages" in (caught.value.details() or "")
    bad_role = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="robot", content="x")])
    with pytest.raises(grpc.RpcError) as caught:
        stub.Complete(bad_role, metadata=CAROL, timeout=5)
    assert "messages[0].role" in (caught.value.details() or "")
    with pytest.raises(grpc.RpcError) as caught:
        stub.Complete(user_turn("x", 1, model="no-such-model"), metadata=CAROL, timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model" in (caught.value.details() or "")


def test_list_replicas_shows_the_pool(mesh: tuple[ServiceProcess, list[ServiceProcess]]) -> None:
    router, replicas = mesh
    pool = router_stub(router).ListReplicas(router_pb2.ListReplicasRequest(), metadata=CAROL, timeout=5)
    assert sorted(r.address for r in pool.replicas) == sorted(r.address for r in replicas)
    assert all(
        r.health == router_pb2.REPLICA_HEALTH_SERVING and r.model == "synthetic" for r in pool.replicas
    )
    assert pool.policy == "auto"


def test_client_deadline_reaches_the_replica(slow_mesh: tuple[ServiceProcess, list[ServiceProcess]]) -> None:
    router, replicas = slow_mesh
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        router_stub(router).Complete(user_turn("slow", 5, request_id="deadline-1"), timeout=0.5)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 2.5
    # The replica's call carried the client's deadline (minus the time already spent), never more.
    # The replica knows it by the request id and the router's suffix (TurnState.engine_id).
    logged = [line for r in replicas for line in r.lines if "request_id=deadline-1." in line]
    assert len(logged) == 1
    assert 0.0 < float(logged[0].rsplit("deadline_s=", 1)[1]) <= 0.5
    assert wait_until_idle(replicas, timeout=3.0) < 2.0


def test_client_cancel_frees_the_replica_at_once(
    slow_mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, replicas = slow_mesh
    stream = router_stub(router).ChatStream(user_turn("long", 100), timeout=30)
    got = [next(stream), next(stream)]
    assert all(m.HasField("delta") for m in got)
    assert sum(running_sequences(r) for r in replicas) == 1
    stream.cancel()
    assert wait_until_idle(replicas, timeout=3.0) < 2.0


def test_chat_cancel_message_ends_the_turn_as_cancelled(
    slow_mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, replicas = slow_mesh
    got_token = threading.Event()

    def client_messages() -> Iterator[router_pb2.ChatRequest]:
        yield user_turn("long answer", 100)
        got_token.wait(10)
        yield router_pb2.ChatRequest(cancel=True)

    responses = []
    for response in router_stub(router).Chat(client_messages(), timeout=30):
        responses.append(response)
        got_token.set()
    assert responses[-1].end.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert responses[-1].seq == len(responses)
    assert wait_until_idle(replicas, timeout=3.0) < 2.0


def test_resume_of_a_cancelled_chat_turn_ends_with_its_cancelled_turn_end(
    mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, _ = mesh
    stub = router_stub(router)
    got_token = threading.Event()

    def client_messages() -> Iterator[router_pb2.ChatRequest]:
        yield user_turn("a long answer to cancel", 4000, request_id="resume-cancelled-1")
        got_token.wait(10)
        yield router_pb2.ChatRequest(cancel=True)

    responses = []
    for response in stub.Chat(client_messages(), metadata=CAROL, timeout=30):
        responses.append(response)
        got_token.set()
    assert responses[-1].end.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    # Resume waits for the buffer's finish, so it can only end after the CANCELLED TurnEnd was stored.
    replayed = read_turn(
        stub.Resume(router_pb2.ResumeRequest(request_id="resume-cancelled-1"), metadata=CAROL, timeout=10)
    )
    assert replayed.messages == responses


def test_kill_9_mid_stream_fails_over_without_losing_or_repeating_a_token() -> None:
    replicas = [synthetic_replica("--tokens-per-second", "40") for _ in range(3)]
    router: ServiceProcess | None = None
    try:
        for r in replicas:
            r.start()
        router = router_process(replicas).start()
        stub = router_stub(router)
        request = user_turn("survive a crash", 40)
        stream = stub.ChatStream(request, timeout=30)
        messages = [next(stream) for _ in range(5)]
        victim = serving_replica(stub)
        assert victim is not None
        next(r for r in replicas if r.address == victim).kill()
        messages += list(stream)
        answer = read_turn(messages)
        assert answer.token_ids == expected_synthetic_ids(request)
        deltas = [m.delta for m in messages if m.HasField("delta")]
        # Each delta says where it starts: no gap, no overlap across the failover.
        assert [d.index for d in deltas] == [
            sum(len(p.token_ids) for p in deltas[:i]) for i in range(len(deltas))
        ]
        assert answer.end.failovers == 1
        assert answer.end.replica != victim
        assert answer.end.finish_reason == common_pb2.FINISH_REASON_LENGTH
    finally:
        for p in [router, *replicas]:
            if p is not None:
                p.stop()


@contextlib.contextmanager
def router_over_a_bad_and_a_good_replica(
    *router_args: str,
) -> Iterator[tuple[router_pb2_grpc.RouterStub, ServiceProcess, ServiceProcess]]:
    """A round-robin router over a replica whose every generation fails (its health says SERVING)
    and a sound one: (router stub, bad, good)."""
    bad = synthetic_replica("--fail-rate", "1.0")
    good = synthetic_replica()
    router: ServiceProcess | None = None
    try:
        bad.start()
        good.start()
        router = router_process([bad, good], "--policy", "round_robin", *router_args).start()
        yield router_stub(router), bad, good
    finally:
        for p in [router, bad, good]:
            if p is not None:
                p.stop()


def test_failures_before_the_first_token_retry_elsewhere_and_eject_the_bad_replica() -> None:
    with router_over_a_bad_and_a_good_replica() as (stub, bad, good):
        ends = [stub.Complete(user_turn(f"q{i}", 2), timeout=10).end for i in range(8)]
        assert all(e.replica == good.address for e in ends)
        # Three failures in a row eject it (the start-up probe may be one of them).
        assert 1 <= sum(e.retries for e in ends) <= 3
        pool = {r.address: r for r in stub.ListReplicas(router_pb2.ListReplicasRequest()).replicas}
        assert pool[bad.address].ejected and pool[bad.address].ejection_count == 1
        assert not pool[good.address].ejected  # never more than half the pool
        # Once ejected, it is not tried any more: no retries.
        assert stub.Complete(user_turn("after", 2), timeout=10).end.retries == 0


def test_the_generation_probe_ejects_a_replica_that_cannot_generate_before_a_client_meets_it() -> None:
    # Health says SERVING, yet every generation fails (a wedged engine): only the one-token probe can
    # tell, and it must, before a client's request is the one that finds out.
    with router_over_a_bad_and_a_good_replica("--probe-interval-s", "0.3", "--ejection-failures", "2") as (
        stub,
        bad,
        good,
    ):
        deadline = time.monotonic() + 20
        while True:
            pool = {r.address: r for r in stub.ListReplicas(router_pb2.ListReplicasRequest()).replicas}
            if pool[bad.address].ejected:
                break
            assert time.monotonic() < deadline, (
                "no client request, and the probe never ejected the bad replica"
            )
            time.sleep(0.1)
        assert pool[bad.address].health == router_pb2.REPLICA_HEALTH_SERVING, (
            "health says SERVING: the probe found it"
        )
        assert not pool[good.address].ejected
        ends = [stub.Complete(user_turn(f"q{i}", 2), timeout=10).end for i in range(4)]
        assert [(e.replica, e.retries) for e in ends] == [(good.address, 0)] * 4


def test_no_replica_is_unavailable_or_a_flagged_degraded_answer() -> None:
    replica = synthetic_replica()
    router: ServiceProcess | None = None
    try:
        replica.start()
        router = router_process([replica]).start()
        replica.kill()
        stub = router_stub(router)
        time.sleep(0.5)  # the health poll notices
        with pytest.raises(grpc.RpcError) as caught:
            stub.Complete(user_turn("anyone?", 2), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "replica" in (caught.value.details() or "")
        degraded = stub.Complete(user_turn("anyone?", 2, allow_degraded=True), timeout=10)
        assert degraded.end.degraded and degraded.text
        assert any("fallback" in reason for reason in degraded.end.degraded_reasons)
    finally:
        for p in [router, replica]:
            if p is not None:
                p.stop()


def test_a_constrained_turn_slow_to_its_first_token_does_not_eject_the_replica() -> None:
    """A request with an output constraint waits for its grammar to compile before its first
    token (seconds for a big schema, queued behind others' compiles): its TTFT timeout was
    counted as the replica failing, so a few big schemas ejected a healthy replica for every
    other client. It still times out; only free-text first tokens count against the replica."""
    replicas = [synthetic_replica("--ttft-ms", "1500") for _ in range(2)]
    router: ServiceProcess | None = None
    try:
        for r in replicas:
            r.start()
        router = router_process(
            replicas, "--ttft-timeout-s", "0.3", "--ejection-failures", "2", "--probe-interval-s", "0"
        ).start()
        stub = router_stub(router)

        def ejections() -> int:
            listed = stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5).replicas
            return sum(r.ejection_count for r in listed)

        schema = user_turn("Give me JSON.", 3)
        schema.sampling.json_object = True
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as slow:
                stub.Complete(schema, timeout=20)
            assert "ttft_timeout" in (slow.value.details() or "")
        assert ejections() == 0
        for _ in range(3):  # the same silence on free text does count
            with pytest.raises(grpc.RpcError):
                stub.Complete(user_turn("Say hi.", 3), timeout=20)
        assert ejections() >= 1
    finally:
        for p in [router, *replicas]:
            if p is not None:
                p.stop()


def test_a_degraded_answer_is_stale_only_for_a_turn_that_may_read_the_cache(
    redis_module: RedisServer,
) -> None:
    """With every replica gone and allow_degraded, a turn that may read the cache gets the stale
    cached answer; one that said bypass or refresh (do not read it: a client clearing a wrong
    answer) got that very answer back before, and now gets the fixed busy reply."""
    replica = synthetic_replica()
    router: ServiceProcess | None = None
    try:
        replica.start()
        router = router_process([replica], "--redis-url", redis_module.url).start()
        stub = router_stub(router)
        question = user_turn("What is stale?", 3)
        fresh = stub.Complete(question, timeout=10)
        assert fresh.text and not fresh.end.degraded
        replica.kill()
        time.sleep(0.5)  # the health poll notices
        stale = stub.Complete(user_turn("What is stale?", 3, allow_degraded=True), timeout=10)
        assert stale.end.cache_layer == router_pb2.CACHE_LAYER_EXACT and stale.text == fresh.text
        for mode in (router_pb2.CACHE_MODE_BYPASS, router_pb2.CACHE_MODE_REFRESH):
            policy = router_pb2.CachePolicy(mode=mode)
            busy = stub.Complete(
                user_turn("What is stale?", 3, allow_degraded=True, cache=policy), timeout=10
            )
            assert busy.end.degraded and busy.text != fresh.text, mode
            assert busy.end.cache_layer == router_pb2.CACHE_LAYER_UNSPECIFIED, mode
    finally:
        for p in [router, replica]:
            if p is not None:
                p.stop()


async def test_replay_writer_batches_messages_without_losing_or_reordering_any(
    redis_module: RedisServer,
) -> None:
    import redis.asyncio

    from services.router.streams.replay import ReplayBuffer
    from services.router.streams.replay_writer import ReplayWriter

    client = redis.asyncio.Redis.from_url(redis_module.url)
    try:
        buffer = ReplayBuffer(client)
        writer = ReplayWriter(buffer, "batched-1", "acme")
        sent = [
            router_pb2.ChatResponse(request_id="batched-1", seq=i, delta=router_pb2.TokenDelta(text=f" {i}"))
            for i in range(1, 301)
        ]
        for message in sent:  # all queued at once: the writer has to batch them
            writer.put(message)
        await writer.close()
        replayed = [
            router_pb2.ChatResponse.FromString(p) async for p in buffer.read_after("batched-1", "acme", 0)
        ]
        assert replayed == sent
    finally:
        await client.aclose()
