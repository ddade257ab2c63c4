"""The router's front door as a client meets it: API keys, tenant isolation, rate limits with RetryInfo."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.admission.auth import KeyLimits
from services.router.admission.keys import add_key, revoke_key
from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer


class FrontDoor:
    """A router with a keys file, one synthetic replica and Redis; keys by name."""

    def __init__(self, router: ServiceProcess, keys: dict[str, str], keys_file: Path) -> None:
        self.router = router
        self.keys = keys
        self.keys_file = keys_file
        self.channel = grpc.insecure_channel(router.address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    def auth(self, name: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.keys[name]}"),)


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontDoor]:
    tmp = Path(tmp_path_factory.mktemp("frontdoor"))
    keys_file = tmp / "keys.yaml"
    keys = {
        "bursty": add_key(keys_file, "acme", "acme-bursty", KeyLimits(requests_per_second=0.2, burst=3))[0],
        "calm": add_key(keys_file, "acme", "acme-calm", KeyLimits(requests_per_second=0.2, burst=3))[0],
        "globex": add_key(keys_file, "globex", "globex-1")[0],
        "revoked": add_key(keys_file, "acme", "acme-old")[0],
        "metered": add_key(keys_file, "acme", "acme-metered", KeyLimits(tokens_per_minute=60))[0],
        "prompty": add_key(keys_file, "acme", "acme-prompty", KeyLimits(tokens_per_minute=600))[0],
    }
    redis = RedisServer(tmp / "redis").start()
    # Paced, so a long answer is still streaming when its client cancels it.
    replica = ServiceProcess("services.synthetic", ["--tokens-per-second", "200"])
    router: ServiceProcess | None = None
    try:
        replica.start(timeout=120)
        router = ServiceProcess(
            "services.router",
            ["--replicas", replica.address, "--redis-url", redis.url, "--api-keys-file", str(keys_file)],
        ).start(timeout=120)
        front = FrontDoor(router, keys, keys_file)
        yield front
        front.channel.close()
    finally:
        if router is not None:
            router.stop()
        replica.stop()
        redis.kill()


def turn(text: str = "Hello", request_id: str = "") -> router_pb2.ChatRequest:
    return router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content=text)],
        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0),
        request_id=request_id,
    )


def retry_delay_s(error: grpc.RpcError) -> float:
    """The RetryInfo delay the router put into the rich status details."""
    trailers = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    return float(info.retry_delay.seconds + info.retry_delay.nanos / 1e9)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ((), "missing API key"),
        ((("authorization", "Bearer llmk_not-a-key"),), "invalid API key"),
        ((("authorization", "Token abc"),), "Bearer"),
    ],
)
def test_missing_or_wrong_key_is_unauthenticated(
    door: FrontDoor, metadata: tuple[tuple[str, str], ...], message: str
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        door.stub.Complete(turn(), metadata=metadata, timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert message in (refused.value.details() or "")


def test_revoked_key_is_refused_once_the_file_changes(door: FrontDoor) -> None:
    assert door.stub.Complete(turn(), metadata=door.auth("revoked"), timeout=10).text
    revoke_key(door.keys_file, "acme-old")
    with pytest.raises(grpc.RpcError) as refused:
        door.stub.Complete(turn(), metadata=door.auth("revoked"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "revoked" in (refused.value.details() or "")


def test_bursting_key_gets_resource_exhausted_with_retry_info_and_another_key_does_not(
    door: FrontDoor,
) -> None:
    for _ in range(3):
        door.stub.Complete(turn(), metadata=door.auth("bursty"), timeout=10)
    with pytest.raises(grpc.RpcError) as refused:
        door.stub.Complete(turn(), metadata=door.auth("bursty"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "acme-bursty" in (refused.value.details() or "")
    assert 0 < retry_delay_s(refused.value) <= 5.0
    # Same tenant, different key: its own bucket, untouched.
    for _ in range(3):
        assert door.stub.Complete(turn(), metadata=door.auth("calm"), timeout=10).end.finish_reason in (
            common_pb2.FINISH_REASON_STOP,
            common_pb2.FINISH_REASON_LENGTH,
        )


def test_tenants_cannot_reach_each_others_tasks_or_streams(door: FrontDoor) -> None:
    # The client tries to pick its tenant through internal metadata: stripped, the key decides.
    smuggled = (*door.auth("globex"), ("x-llmmesh-tenant", "acme"))
    task = door.stub.SubmitTask(router_pb2.SubmitTaskRequest(request=turn()), metadata=smuggled, timeout=10)
    assert door.stub.GetTask(
        router_pb2.GetTaskRequest(task_id=task.task_id), metadata=door.auth("globex"), timeout=10
    )
    for rpc, request in (
        (door.stub.GetTask, router_pb2.GetTaskRequest(task_id=task.task_id)),
        (door.stub.CancelTask, router_pb2.CancelTaskRequest(task_id=task.task_id)),
    ):
        with pytest.raises(grpc.RpcError) as denied:
            rpc(request, metadata=door.auth("calm"), timeout=10)  # type: ignore[operator]
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED

    list(door.stub.ChatStream(turn(request_id="globex-private"), metadata=door.auth("globex"), timeout=10))
    with pytest.raises(grpc.RpcError) as denied:
        list(
            door.stub.Resume(
                router_pb2.ResumeRequest(request_id="globex-private"), metadata=door.auth("calm"), timeout=10
            )
        )
    # A request id is the tenant's own: another tenant's turn by it is not theirs to know of.
    assert denied.value.code() == grpc.StatusCode.NOT_FOUND
    replayed = list(
        door.stub.Resume(
            router_pb2.ResumeRequest(request_id="globex-private"), metadata=door.auth("globex"), timeout=10
        )
    )
    assert replayed[-1].HasField("end")


def cancelled_after(
    door: FrontDoor, key: str, text: str, tokens: int
) -> tuple[int, router_pb2.TurnEnd | None]:
    """A long answer to ``text`` on the Chat stream, cancelled once ``tokens`` have come: how many
    came, and the turn's end."""
    enough = threading.Event()

    def client_messages() -> Iterator[router_pb2.ChatRequest]:
        request = turn(text)
        request.sampling.max_tokens = 4000
        yield request
        enough.wait(20)
        yield router_pb2.ChatRequest(cancel=True)

    streamed = 0
    ended = None
    for response in door.stub.Chat(client_messages(), metadata=door.auth(key), timeout=30):
        streamed += len(response.delta.token_ids)
        if streamed >= tokens:
            enough.set()
        if response.HasField("end"):
            ended = response.end
    return streamed, ended


def test_an_answer_cancelled_part_way_is_charged_the_tokens_it_streamed(door: FrontDoor) -> None:
    """A client that read an answer and cancelled before its end paid nothing: its key could take
    any number of tokens that way. Now the tokens streamed are charged, so past the key's budget
    (60 tokens/min) its next turn is refused."""
    _, ended = cancelled_after(door, "metered", "a long answer", 90)
    assert ended is not None and ended.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    time.sleep(0.5)  # the charge is written beside the turn's end
    with pytest.raises(grpc.RpcError) as refused:
        door.stub.Complete(turn(), metadata=door.auth("metered"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert "60 tokens/min" in refused.value.details()  # type: ignore[attr-defined]


def test_a_stream_cancelled_after_its_first_tokens_is_charged_its_prompt_too(door: FrontDoor) -> None:
    """The replica counted the prompt only in its end, so a stream cancelled after one token
    prefilled any prompt for free: ten 7,500-token prompts went through a 600 tokens/min key and
    left it full. The first chunk now says the prompt's size: the turn reports it and is charged it."""
    long_prompt = "lorem ipsum dolor " * 400  # 7,200 characters: 1,801 tokens as the replica counts
    streamed, ended = cancelled_after(door, "prompty", long_prompt, 1)
    assert ended is not None and ended.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert ended.usage.prompt_tokens == (len(long_prompt) + 4) // 4
    assert ended.usage.completion_tokens == streamed
    time.sleep(0.5)  # the charge is written beside the turn's end
    with pytest.raises(grpc.RpcError) as refused:
        door.stub.Complete(turn(), metadata=door.auth("prompty"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    # In debt by the prompt and the streamed tokens past the minute's 600, at 10 tokens a second.
    owed = ended.usage.prompt_tokens + streamed - 600
    assert retry_delay_s(refused.value) == pytest.approx(owed / 10, abs=3.0)
