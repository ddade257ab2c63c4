"""A small async client for the session service that acts for one tenant, as the router would."""

from __future__ import annotations

import uuid
from typing import Any

import grpc
import pytest

from services.common.metadata import TENANT_KEY
from services.gen.llmmesh.v1 import session_pb2 as pb
from services.gen.llmmesh.v1 import session_pb2_grpc as pb_grpc


class SessionClient:
    """Every call carries `x-llmmesh-tenant: <owner>` (None sends no tenant at all)."""

    def __init__(self, channel: grpc.aio.Channel, owner: str | None, timeout: float = 5.0) -> None:
        self.stub = pb_grpc.SessionStub(channel)
        self.owner = owner
        self.timeout = timeout

    def _kw(self) -> dict[str, Any]:
        metadata = ((TENANT_KEY, self.owner),) if self.owner is not None else ()
        return {"metadata": metadata, "timeout": self.timeout}

    async def create(self, session_id: str = "", **fields: Any) -> pb.SessionInfo:
        return await self.stub.CreateSession(
            pb.CreateSessionRequest(session_id=session_id, **fields), **self._kw()
        )

    async def get(self, session_id: str, **fields: Any) -> pb.SessionState:
        return await self.stub.GetSession(pb.GetSessionRequest(session_id=session_id, **fields), **self._kw())

    async def append(
        self, session_id: str, turns: list[pb.Turn], expected_version: int | None = None, request_id: str = ""
    ) -> pb.AppendTurnsResponse:
        request = pb.AppendTurnsRequest(session_id=session_id, turns=turns, request_id=request_id)
        if expected_version is not None:
            request.expected_version = expected_version
        return await self.stub.AppendTurns(request, **self._kw())

    async def delete(self, session_id: str) -> pb.DeleteSessionResponse:
        return await self.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id), **self._kw())

    async def list(self, page_size: int = 0, page_token: str = "") -> pb.ListSessionsResponse:
        return await self.stub.ListSessions(
            pb.ListSessionsRequest(page_size=page_size, page_token=page_token), **self._kw()
        )

    async def touch(self, session_id: str) -> pb.SessionInfo:
        return await self.stub.TouchSession(pb.TouchSessionRequest(session_id=session_id), **self._kw())


def turn(content: str, role: str = "user", **fields: Any) -> pb.Turn:
    return pb.Turn(role=role, content=content, **fields)


def new_owner() -> str:
    """A tenant of its own: tests sharing one service keep out of each other's sessions."""
    return f"tenant-{uuid.uuid4().hex[:8]}"


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    """The status ``call`` (an RPC's awaitable) fails with; the test fails if it succeeds."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value
