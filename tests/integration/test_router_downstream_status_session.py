"""What a client sees when the session service answers a turn's history call with a status
(issue #19, docs/router.md, "Downstream statuses").

A fake session service on a loopback socket (the router calls GetSession before the answer,
CreateSession/AppendTurns after it) fails the step a case names with the injected status;
the replica is tests/support/status_replica.py answering normally. For each of ChatStream,
Chat and Complete the client must see the mapped status naming the session, or, for a
session outage, the answer without history, flagged degraded.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest

from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, session_pb2, session_pb2_grpc
from tests.support.processes import ServiceProcess
from tests.support.status_replica import StatusReplica, status_replica

SESSION = "conv-7"
TOKENS = 3
CLIENT_FAULTS = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
OUTAGES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass
class FakeSession(session_pb2_grpc.SessionServicer):
    """Fails ``failing`` ("load": GetSession; "save": CreateSession and AppendTurns) with
    ``status``; the other step answers as for a session at version 1."""

    status: grpc.StatusCode = grpc.StatusCode.OK
    failing: str = "load"
    calls: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _answer(self, method: str, step: str, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.calls.append(method)
        if step == self.failing and self.status != grpc.StatusCode.OK:
            context.abort(self.status, f"fake session: {method} says {self.status.name}")

    def GetSession(
        self, request: session_pb2.GetSessionRequest, context: grpc.ServicerContext
    ) -> session_pb2.SessionState:  # type: ignore[override]
        self._answer("GetSession", "load", context)
        info = session_pb2.SessionInfo(session_id=request.session_id, version=1, turn_count=2)
        turns = [
            session_pb2.Turn(role="user", content="hi"),
            session_pb2.Turn(role="assistant", content="hello"),
        ]
        return session_pb2.SessionState(info=info, turns=turns)

    def CreateSession(
        self, request: session_pb2.CreateSessionRequest, context: grpc.ServicerContext
    ) -> session_pb2.SessionInfo:  # type: ignore[override]
        self._answer("CreateSession", "save", context)
        return session_pb2.SessionInfo(session_id=request.session_id)

    def AppendTurns(
        self, request: session_pb2.AppendTurnsRequest, context: grpc.ServicerContext
    ) -> session_pb2.AppendTurnsResponse:  # type: ignore[override]
        self._answer("AppendTurns", "save", context)
        return session_pb2.AppendTurnsResponse(version=request.expected_version + 1)


#: The client's status and message when the session service answers the step with a client-side
#: fault (the session's own answer, naming the session). NOT_FOUND on load is a new session.
FAULT_MESSAGES = {
    grpc.StatusCode.INVALID_ARGUMENT: "session_id: fake session: {method} says INVALID_ARGUMENT",
    grpc.StatusCode.NOT_FOUND: f"session_id: {SESSION!r} not found",
    grpc.StatusCode.PERMISSION_DENIED: f"session_id: {SESSION!r}: fake session: {{method}} says PERMISSION_DENIED",
    grpc.StatusCode.RESOURCE_EXHAUSTED: f"session {SESSION!r}: fake session: {{method}} says RESOURCE_EXHAUSTED",
}


@dataclass(frozen=True)
class Seen:
    code: grpc.StatusCode
    details: str
    text: str
    end: router_pb2.TurnEnd | None


def turn(required: str = "") -> router_pb2.ChatRequest:
    """A session's turn; ``required``: the field that requires the session, if any."""
    request = router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content="and now?")],
        sampling=common_pb2.SamplingParams(max_tokens=8),
        session_id=SESSION,
    )
    if required:
        setattr(request, required, True)
    return request


def run(stub: router_pb2_grpc.RouterStub, rpc: str, required: str = "") -> Seen:
    request = turn(required)
    messages: list[router_pb2.ChatResponse] = []
    try:
        if rpc == "Complete":
            response = stub.Complete(request, timeout=20)
            return Seen(grpc.StatusCode.OK, "", response.text, response.end)
        calls = (
            stub.ChatStream(request, timeout=20)
            if rpc == "ChatStream"
            else stub.Chat(iter([request]), timeout=20)
        )
        messages.extend(calls)
    except grpc.RpcError as exc:
        text = "".join(m.delta.text for m in messages)
        return Seen(exc.code(), exc.details() or "", text, None)  # type: ignore[attr-defined]
    text = "".join(m.delta.text for m in messages if m.HasField("delta"))
    return Seen(grpc.StatusCode.OK, "", text, messages[-1].end)


@pytest.fixture(scope="module")
def replica() -> Iterator[StatusReplica]:
    with status_replica() as fake:
        fake.code, fake.tokens_before = grpc.StatusCode.OK, TOKENS
        yield fake


@pytest.fixture(scope="module")
def session() -> Iterator[tuple[FakeSession, str]]:
    servicer = FakeSession()  # type: ignore[abstract]  # the router calls only these three
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    session_pb2_grpc.add_SessionServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def router(replica: StatusReplica, session: tuple[FakeSession, str]) -> Iterator[router_pb2_grpc.RouterStub]:
    args = ["--replicas", replica.address, "--session-addr", session[1], "--probe-interval-s", "0"]
    with (
        ServiceProcess(
            "services.router", [*args, "--health-interval-s", "0.2", "--metrics-port", "0"]
        ) as process,
        grpc.insecure_channel(process.address) as channel,
    ):
        yield router_pb2_grpc.RouterStub(channel)


ANSWER = "".join(f" t{i}" for i in range(TOKENS))
RPCS = ("ChatStream", "Chat", "Complete")
# The outages are spread out: five in a row would open the router's session breaker
# (tests/unit/router/admission/test_breaker.py), and the cases after it would not reach the fake at all.
CASES = [
    (code, step, rpc) for step in ("load", "save") for rpc in RPCS for code in (*CLIENT_FAULTS, *OUTAGES)
]


@pytest.mark.parametrize(("injected", "step", "rpc"), CASES, ids=lambda v: getattr(v, "name", v))
def test_each_session_status_reaches_the_client_mapped(
    router: router_pb2_grpc.RouterStub,
    session: tuple[FakeSession, str],
    injected: grpc.StatusCode,
    step: str,
    rpc: str,
) -> None:
    fake, _ = session
    fake.status, fake.failing = injected, step
    del fake.calls[:]
    seen = run(router, rpc)
    method = "GetSession" if step == "load" else "AppendTurns"
    assert method in fake.calls, "the router did not call the session service"
    if step == "load" and injected == grpc.StatusCode.NOT_FOUND:
        # No such session yet: the turn is its first, answered and saved as a new session.
        assert (seen.code, seen.text) == (grpc.StatusCode.OK, ANSWER)
        assert seen.end is not None and not seen.end.degraded and seen.end.session_version == 1
        assert fake.calls == ["GetSession", "CreateSession", "AppendTurns"]
        return
    if injected in CLIENT_FAULTS:
        assert (seen.code, seen.details) == (injected, FAULT_MESSAGES[injected].format(method=method))
        if step == "load":
            assert seen.text == "" and fake.calls == ["GetSession"], "answered a turn it refused"
        elif rpc != "Complete":
            assert seen.text == ANSWER  # the answer streamed before the save failed; it was not saved
        return
    # An outage: the turn is answered anyway, flagged degraded, with the reason.
    assert (seen.code, seen.text) == (grpc.StatusCode.OK, ANSWER), seen
    assert seen.end is not None and seen.end.degraded
    reason = (
        "history: session unavailable: " if step == "load" else "history not saved: session unavailable: "
    )
    assert any(r.startswith(reason) and injected.name in r for r in seen.end.degraded_reasons), seen.end
    assert seen.end.session_version == 0
    if step == "load":
        assert fake.calls == ["GetSession"], "saved a turn over history it could not read"


@pytest.mark.parametrize("required", ["session_required", "session_must_exist"])
@pytest.mark.parametrize("step", ["load", "save"])
@pytest.mark.parametrize("injected", OUTAGES, ids=lambda c: c.name)
def test_a_session_outage_is_unavailable_when_the_session_is_required(
    router: router_pb2_grpc.RouterStub,
    session: tuple[FakeSession, str],
    injected: grpc.StatusCode,
    step: str,
    required: str,
) -> None:
    """session_must_exist implies session_required (router.proto): at save time too, where an
    outage was only a degraded note."""
    fake, _ = session
    fake.status, fake.failing = injected, step
    seen = run(router, "Complete", required=required)
    assert seen.code == grpc.StatusCode.UNAVAILABLE
    assert seen.details.startswith("session unavailable: ") and injected.name in seen.details
    fake.status = grpc.StatusCode.OK
    assert run(router, "Complete").code == grpc.StatusCode.OK  # and the breaker closes again
