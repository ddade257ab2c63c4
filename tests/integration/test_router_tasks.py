"""Async tasks and Resume through real router processes: a task survives kill -9 of its router,
and a client whose connection dropped gets the missing messages exactly once from any router."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from redis import Redis

from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.admission.auth import KeyLimits
from services.router.admission.keys import add_key
from services.router.tasks.keys import STANDALONE_KEYS
from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer

# Short visibility timeout so the surviving router takes over within seconds, not the default 30.
TASK_ENV = {"LLMMESH_TASK_VISIBILITY_SECONDS": "1.5"}


def start_router(
    replica: ServiceProcess, redis: RedisServer, session_addr: str = "", extra: tuple[str, ...] = ()
) -> ServiceProcess:
    args = [
        *extra,
        "--replicas",
        replica.address,
        "--redis-url",
        redis.url,
        "--policy",
        "round_robin",
        "--metrics-port",
        "0",
    ]
    if session_addr:
        args += ["--session-addr", session_addr]
    return ServiceProcess("services.router", args, env=TASK_ENV).start(timeout=120)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, ServiceProcess]]:
    redis = RedisServer(Path(tmp_path_factory.mktemp("redis"))).start()
    # A synthetic token source (no model): deterministic tokens, paced at 50 tokens/s.
    replica = ServiceProcess("services.synthetic", ["--tokens-per-second", "50"])
    try:
        replica.start(timeout=120)
        yield redis, replica
    finally:
        replica.stop()
        redis.kill()


@pytest.fixture(scope="module")
def session_service(mesh: tuple[RedisServer, ServiceProcess]) -> Iterator[ServiceProcess]:
    session = ServiceProcess("services.session", ["--redis-url", mesh[0].url, "--log-level", "WARNING"])
    try:
        yield session.start(timeout=120)
    finally:
        session.stop()


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def redis_client(redis: RedisServer) -> Redis:
    return Redis.from_url(redis.url, socket_timeout=5)


def stub_for(process: ServiceProcess) -> tuple[grpc.Channel, router_pb2_grpc.RouterStub]:
    channel = grpc.insecure_channel(process.address)
    return channel, router_pb2_grpc.RouterStub(channel)


def chat_request(text: str, max_tokens: int, request_id: str = "") -> router_pb2.ChatRequest:
    return router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content=text)],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        request_id=request_id,
        cache=router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS),
    )


def read_then_drop(
    router: ServiceProcess,
    request: router_pb2.ChatRequest,
    count: int,
    metadata: tuple[tuple[str, str], ...] = (),
) -> list[router_pb2.ChatResponse]:
    """The first ``count`` messages of a ChatStream, then the connection dropped mid-answer."""
    channel, stub = stub_for(router)
    received: list[router_pb2.ChatResponse] = []
    call = stub.ChatStream(request, timeout=30, metadata=metadata)
    for response in call:
        received.append(response)
        if len(received) == count:
            break
    time.sleep(1.0)  # the router keeps sending into the void (and its replay buffer) meanwhile
    call.cancel()
    channel.close()  # the connection is gone
    return received


def wait_task(
    stub: router_pb2_grpc.RouterStub,
    task_id: str,
    done: set[int],
    timeout: float,
    metadata: tuple[tuple[str, str], ...] = (),
) -> router_pb2.Task:
    deadline = time.monotonic() + timeout
    while True:
        task = stub.GetTask(router_pb2.GetTaskRequest(task_id=task_id), timeout=5, metadata=metadata)
        if task.state in done or time.monotonic() > deadline:
            return task
        time.sleep(0.1)


@pytest.mark.parametrize("in_a_session", [False, True], ids=["no-session", "session"])
def test_task_survives_kill_9_of_its_router(
    mesh: tuple[RedisServer, ServiceProcess], request: pytest.FixtureRequest, in_a_session: bool
) -> None:
    redis, replica = mesh
    session_addr = request.getfixturevalue("session_service").address if in_a_session else ""
    session_id = "story-session" if in_a_session else ""
    first = start_router(replica, redis, session_addr)
    second: ServiceProcess | None = None
    try:
        channel, stub = stub_for(first)
        with channel:
            story = chat_request("Tell me a long story.", max_tokens=100)
            story.session_id = session_id
            task = stub.SubmitTask(router_pb2.SubmitTaskRequest(request=story), timeout=10)
            assert task.state == router_pb2.TASK_STATE_QUEUED
            running = wait_task(stub, task.task_id, {router_pb2.TASK_STATE_RUNNING}, timeout=20)
            assert running.state == router_pb2.TASK_STATE_RUNNING
            # Part of the answer is out (50 tokens/s: 100 take 2 s) when the router dies.
            deadline = time.monotonic() + 10
            while not stub.GetTask(router_pb2.GetTaskRequest(task_id=task.task_id), timeout=5).text:
                assert time.monotonic() < deadline, "no token reached the task"
                time.sleep(0.05)
        first.kill()  # kill -9 mid-generation: no drain, no acknowledgement

        second = start_router(replica, redis, session_addr)
        channel, stub = stub_for(second)
        with channel:
            finished = wait_task(
                stub,
                task.task_id,
                {
                    router_pb2.TASK_STATE_SUCCEEDED,
                    router_pb2.TASK_STATE_FAILED,
                    router_pb2.TASK_STATE_CANCELLED,
                },
                timeout=60,
            )
            assert finished.state == router_pb2.TASK_STATE_SUCCEEDED, finished.error_message
            assert finished.end.usage.completion_tokens == 100
            # The answer is the whole, uninterrupted one: the same as running the turn directly
            # (in a new session: the same prompt, no history yet).
            fresh = router_pb2.ChatRequest()
            fresh.CopyFrom(story)
            fresh.session_id = f"{session_id}-fresh" if in_a_session else ""
            direct = stub.Complete(fresh, timeout=30)
            assert finished.text == direct.text
            # Read from the task, not Resume: its attempts left nothing in the Resume buffer,
            # where the second one's messages (numbered from 1 again) were spliced into the
            # first's under the same request id, losing the tokens between.
            with pytest.raises(grpc.RpcError) as buffered:
                list(stub.Resume(router_pb2.ResumeRequest(request_id=f"task-{task.task_id}"), timeout=10))
            assert buffered.value.code() == grpc.StatusCode.NOT_FOUND
            if in_a_session:
                # Saved once, against the version read before the first token: the next turn is
                # the session's second.
                assert finished.end.session_version == 1, finished.end
                follow_up = chat_request("And then?", 4)
                follow_up.session_id = session_id
                assert stub.Complete(follow_up, timeout=30).end.session_version == 2
        # A watcher saw each token once: the new router continued after the tokens the dead one
        # delivered (same prompt, same model, resume_token_ids) instead of starting again.
        positions: list[int] = []
        for _, fields in redis_client(redis).xrange(STANDALONE_KEYS.events(task.task_id)):
            if fields[b"k"] == b"delta":
                delta = router_pb2.TokenDelta.FromString(fields[b"p"])
                positions.extend(range(delta.index, delta.index + len(delta.token_ids)))
        assert positions == list(range(100))
        # It was this router that took the task over from the dead one, and continued it.
        assert second.metrics_port is not None
        metrics = metrics_text(second.metrics_port)
        assert "llmmesh_router_tasks_reclaimed_total 1.0" in metrics
        assert "llmmesh_router_tasks_resumed_total 1.0" in metrics
    finally:
        first.kill()
        if second is not None:
            second.stop()


def test_a_task_taken_over_is_not_admitted_again(
    mesh: tuple[RedisServer, ServiceProcess], tmp_path: Path
) -> None:
    """The key may start one turn per 100 s, and its task's turn took it. The router running the
    task dies mid-answer: the survivor finishes the task at once, without a second admission
    (which would wait out the key's rate, or fail the task), and the key's next turn is still
    refused for the rate: the takeover spent nothing."""
    redis, replica = mesh
    keys_file = tmp_path / "keys.yaml"
    key, _ = add_key(keys_file, "acme", "acme-one-per-100s", KeyLimits(requests_per_second=0.01, burst=1))
    auth = (("authorization", f"Bearer {key}"),)
    with_keys = ("--api-keys-file", str(keys_file))
    first = start_router(replica, redis, extra=with_keys)
    second: ServiceProcess | None = None
    try:
        channel, stub = stub_for(first)
        with channel:
            story = chat_request("Tell me another long story.", max_tokens=100)
            task = stub.SubmitTask(router_pb2.SubmitTaskRequest(request=story), timeout=10, metadata=auth)
            deadline = time.monotonic() + 20
            while not stub.GetTask(
                router_pb2.GetTaskRequest(task_id=task.task_id), timeout=5, metadata=auth
            ).text:
                assert time.monotonic() < deadline, "no token reached the task"
                time.sleep(0.05)
        first.kill()

        second = start_router(replica, redis, extra=with_keys)
        channel, stub = stub_for(second)
        with channel:
            ended = {
                router_pb2.TASK_STATE_SUCCEEDED,
                router_pb2.TASK_STATE_FAILED,
                router_pb2.TASK_STATE_CANCELLED,
            }
            finished = wait_task(stub, task.task_id, ended, timeout=30, metadata=auth)
            assert finished.state == router_pb2.TASK_STATE_SUCCEEDED, finished
            assert finished.end.usage.completion_tokens == 100
            with pytest.raises(grpc.RpcError) as refused:
                stub.Complete(chat_request("One more?", 4), timeout=10, metadata=auth)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert second.metrics_port is not None
        assert "llmmesh_router_tasks_resumed_total 1.0" in metrics_text(second.metrics_port)
    finally:
        first.kill()
        if second is not None:
            second.stop()


def test_resume_after_a_dropped_connection_returns_the_missing_messages_once(
    mesh: tuple[RedisServer, ServiceProcess],
) -> None:
    redis, replica = mesh
    routers = [start_router(replica, redis), start_router(replica, redis)]
    try:
        request = chat_request("Count for me.", max_tokens=12, request_id="resume-test-1")
        received = read_then_drop(routers[0], request, 4)

        # The client reconnects to another router instance and resumes after what it saw.
        channel, stub = stub_for(routers[1])
        with channel:
            last_seq = received[-1].seq
            resumed = list(
                stub.Resume(
                    router_pb2.ResumeRequest(request_id="resume-test-1", last_seq=last_seq), timeout=30
                )
            )
            seqs = [r.seq for r in received + resumed]
            assert seqs == list(range(1, len(seqs) + 1))  # contiguous: nothing lost, nothing twice
            assert resumed[-1].HasField("end")
            text = "".join(r.delta.text for r in received + resumed if r.HasField("delta"))
            ids = [t for r in received + resumed if r.HasField("delta") for t in r.delta.token_ids]
            direct = stub.Complete(chat_request("Count for me.", max_tokens=12), timeout=30)
            assert (text, ids) == (direct.text, list(direct.token_ids))

            with pytest.raises(grpc.RpcError) as missing:
                list(stub.Resume(router_pb2.ResumeRequest(request_id="never-ran"), timeout=10))
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        for router in routers:
            router.stop()


@pytest.mark.parametrize(
    "bad_id",
    ["x" * 10_000, "two words", "line\nforged: INFO all good", ""],
    ids=["10k", "space", "newline", "empty"],
)
def test_client_chosen_ids_that_could_forge_logs_or_overflow_a_status_are_invalid_argument(
    mesh: tuple[RedisServer, ServiceProcess], bad_id: str
) -> None:
    """Request and task ids go into logs, Redis keys and error messages. A 10 KB id echoed in a
    NOT_FOUND made the status too big for gRPC's metadata limit (RESOURCE_EXHAUSTED reached the
    client instead); a newline would forge a log line."""
    redis, replica = mesh
    router = start_router(replica, redis)
    try:
        channel, stub = stub_for(router)
        with channel:
            calls = {
                "task_id": [
                    lambda: stub.GetTask(router_pb2.GetTaskRequest(task_id=bad_id), timeout=10),
                    lambda: list(stub.WatchTask(router_pb2.WatchTaskRequest(task_id=bad_id), timeout=10)),
                    lambda: stub.CancelTask(router_pb2.CancelTaskRequest(task_id=bad_id), timeout=10),
                ],
                "request_id": [
                    lambda: list(stub.Resume(router_pb2.ResumeRequest(request_id=bad_id), timeout=10)),
                ],
            }
            if bad_id:  # an empty request id on a turn means "mint one"
                calls["request_id"].append(
                    lambda: stub.Complete(chat_request("Hi.", max_tokens=2, request_id=bad_id), timeout=30)
                )
            for field, field_calls in calls.items():
                for call in field_calls:
                    with pytest.raises(grpc.RpcError) as refused:
                        call()
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
                    assert (refused.value.details() or "").startswith(f"{field}: "), refused.value.details()
            # A well-formed id that nobody used is still NOT_FOUND.
            with pytest.raises(grpc.RpcError) as unknown:
                stub.GetTask(router_pb2.GetTaskRequest(task_id="no-such-task"), timeout=10)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        router.stop()


def test_a_task_for_a_model_no_replica_serves_is_refused_at_submit(
    mesh: tuple[RedisServer, ServiceProcess],
) -> None:
    """A misspelt model used to be accepted, queued, and fail only when a worker ran it: the
    client polled a task that never had a chance. It is refused as the turn itself would be."""
    redis, replica = mesh
    router = start_router(replica, redis)
    try:
        channel, stub = stub_for(router)
        with channel:
            queued_before = redis_client(redis).xlen(STANDALONE_KEYS.stream)
            typo = chat_request("Hi.", max_tokens=2)
            typo.model = "no-such-model"
            with pytest.raises(grpc.RpcError) as refused:
                stub.SubmitTask(router_pb2.SubmitTaskRequest(request=typo), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = refused.value.details() or ""
            assert details.startswith("request.model: unknown model 'no-such-model'"), details
            assert "this router serves:" in details
            assert redis_client(redis).xlen(STANDALONE_KEYS.stream) == queued_before
            # The model the replica serves, by name, is accepted and runs.
            served = stub.Complete(chat_request("Hi.", max_tokens=2), timeout=30).end.model
            named = chat_request("Hi.", max_tokens=2)
            named.model = served
            task = stub.SubmitTask(router_pb2.SubmitTaskRequest(request=named), timeout=10)
            done = wait_task(
                stub, task.task_id, {router_pb2.TASK_STATE_SUCCEEDED, router_pb2.TASK_STATE_FAILED}, 30
            )
            assert done.state == router_pb2.TASK_STATE_SUCCEEDED, done.error
    finally:
        router.stop()
