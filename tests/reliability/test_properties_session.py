"""Any Session request → OK or a clear status naming the field (matrix row 11)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gen.llmmesh.v1 import session_pb2, session_pb2_grpc
from tests.reliability.property_support import check_status
from tests.support.processes import ServiceProcess
from tests.support.protofuzz import messages
from tests.support.redis import RedisServer

TENANT = (("x-llmmesh-tenant", "acme"),)
RPCS = [
    ("CreateSession", session_pb2.CreateSessionRequest),
    ("GetSession", session_pb2.GetSessionRequest),
    ("AppendTurns", session_pb2.AppendTurnsRequest),
    ("DeleteSession", session_pb2.DeleteSessionRequest),
    ("ListSessions", session_pb2.ListSessionsRequest),
    ("TouchSession", session_pb2.TouchSessionRequest),
]


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[session_pb2_grpc.SessionStub]:
    redis = RedisServer(Path(tmp_path_factory.mktemp("redis"))).start()
    proc = ServiceProcess("services.session", ["--redis-url", redis.url]).start()
    channel = grpc.insecure_channel(proc.address)
    yield session_pb2_grpc.SessionStub(channel)
    channel.close()
    proc.stop()
    redis.kill()


@pytest.mark.parametrize(("rpc", "request_cls"), RPCS, ids=[r for r, _ in RPCS])
def test_any_request_gets_ok_or_a_clear_status(
    stub: session_pb2_grpc.SessionStub, rpc: str, request_cls: type
) -> None:
    method = getattr(stub, rpc)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request=messages(request_cls.DESCRIPTOR, request_cls), existing=st.booleans())
    def run(request: object, existing: bool) -> None:
        if existing and hasattr(request, "session_id"):
            created = stub.CreateSession(session_pb2.CreateSessionRequest(), metadata=TENANT, timeout=5)
            request.session_id = created.session_id  # type: ignore[attr-defined]
        try:
            method(request, metadata=TENANT, timeout=10)
        except grpc.RpcError as err:
            check_status(err.code(), err.details() or "", request_cls.DESCRIPTOR)

    run()
