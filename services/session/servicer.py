"""The gRPC face of the session service: protobuf in, SessionStore calls, protobuf out."""

from __future__ import annotations

import uuid
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from services.common.metadata import TENANT_KEY, metadata_value
from services.gen.llmmesh.v1 import session_pb2 as pb
from services.session import validation
from services.session.limits import SessionLimits
from services.session.metrics import observe_op
from services.session.model import NewSession, SessionHeader, TurnRecord
from services.session.store import SessionStore
from services.session.window import TURN_OVERHEAD_TOKENS, select_window
from services.session.wire import UndecodableRequest, tolerant_deserializer

SERVICE_NAME = "llmmesh.v1.Session"
Context = grpc.aio.ServicerContext[Any, Any]
M = TypeVar("M", bound=Message)


def parsed(request: M | UndecodableRequest) -> M:
    if isinstance(request, UndecodableRequest):
        raise request.error
    return request


def owner_of(context: Context) -> str:
    return validation.check_owner(metadata_value(context.invocation_metadata(), TENANT_KEY))


def header_pb(header: SessionHeader, max_turns: int) -> pb.SessionInfo:
    return pb.SessionInfo(
        session_id=header.session_id,
        owner=header.owner,
        system_prompt=header.system_prompt,
        metadata=dict(header.metadata),
        version=header.version,
        turn_count=header.turn_count,
        ttl_seconds=header.ttl_seconds,
        created_at_ms=header.created_at_ms,
        updated_at_ms=header.updated_at_ms,
        max_turns=max_turns,
    )


def turn_pb(turn: TurnRecord) -> pb.Turn:
    message = pb.Turn(
        role=turn.role,
        content=turn.content,
        created_at_ms=turn.created_at_ms,
        metadata=dict(turn.metadata),
        request_id=turn.request_id,
    )
    if turn.token_count is not None:
        message.token_count = turn.token_count
    return message


def turn_record(message: pb.Turn) -> TurnRecord:
    return TurnRecord(
        role=message.role,
        content=message.content,
        token_count=message.token_count if message.HasField("token_count") else None,
        metadata=dict(message.metadata),
    )


class SessionServicer:
    """Validates, calls the store, converts; every handler counts its op by result."""

    def __init__(self, store: SessionStore, limits: SessionLimits) -> None:
        self._store = store
        self._limits = limits

    def _info(self, header: SessionHeader) -> pb.SessionInfo:
        return header_pb(header, self._limits.max_turns_per_session)

    async def CreateSession(
        self, request: pb.CreateSessionRequest | UndecodableRequest, context: Context
    ) -> pb.SessionInfo:
        async with observe_op("create"):
            req = parsed(request)
            owner = owner_of(context)
            session_id = validation.check_session_id(req.session_id) if req.session_id else uuid.uuid4().hex
            validation.check_system_prompt(req.system_prompt, req.metadata, self._limits)
            new = NewSession(
                session_id=session_id,
                owner=owner,
                system_prompt=req.system_prompt,
                metadata=dict(req.metadata),
                ttl_seconds=validation.check_ttl(req.ttl_seconds, self._limits),
            )
            return self._info(await self._store.create(new))

    async def GetSession(
        self, request: pb.GetSessionRequest | UndecodableRequest, context: Context
    ) -> pb.SessionState:
        async with observe_op("get"):
            req = parsed(request)
            owner = owner_of(context)
            session_id = validation.check_session_id(req.session_id)
            before = validation.check_request_id(req.before_request_id, "before_request_id")
            # Redis sends only the turns the window could hold: every turn costs the template's
            # TURN_OVERHEAD_TOKENS at least. Reading a 1,000-turn session whole for each turn
            # took every turn's bytes through Redis and the service (up to 64 MiB).
            fetch = req.max_turns
            if req.token_budget:
                most = max(1, req.token_budget // TURN_OVERHEAD_TOKENS)
                fetch = min(fetch, most) if fetch else most
            # With before_request_id, the window ends before that request's turns: a retry's
            # window is the one its first try had (as far as the session still holds it).
            read = await self._store.get(owner, session_id, fetch, before)
            window, _ = select_window(
                read.header.system_prompt,
                read.turns,
                token_budget=req.token_budget,
                preceded=read.stop > len(read.turns),
            )
            return pb.SessionState(
                info=self._info(read.header),
                turns=[turn_pb(t) for t in window],
                omitted_turns=read.stop - len(window),
                holds_request=read.holds_request,
                request_turns=[turn_pb(t) for t in read.request_turns],
            )

    async def AppendTurns(
        self, request: pb.AppendTurnsRequest | UndecodableRequest, context: Context
    ) -> pb.AppendTurnsResponse:
        async with observe_op("append"):
            req = parsed(request)
            owner = owner_of(context)
            session_id = validation.check_session_id(req.session_id)
            turns = [turn_record(t) for t in req.turns]
            validation.check_turns(turns, self._limits)
            expected = req.expected_version if req.HasField("expected_version") else None
            request_id = validation.check_request_id(req.request_id, "request_id")
            created = req.expected_created_at_ms if req.HasField("expected_created_at_ms") else None
            header, duplicate = await self._store.append(
                owner, session_id, turns, expected, request_id, created
            )
            return pb.AppendTurnsResponse(
                version=header.version, info=self._info(header), duplicate=duplicate
            )

    async def DeleteSession(
        self, request: pb.DeleteSessionRequest | UndecodableRequest, context: Context
    ) -> pb.DeleteSessionResponse:
        async with observe_op("delete"):
            req = parsed(request)
            owner = owner_of(context)
            await self._store.delete(owner, validation.check_session_id(req.session_id))
            return pb.DeleteSessionResponse(deleted=True)

    async def ListSessions(
        self, request: pb.ListSessionsRequest | UndecodableRequest, context: Context
    ) -> pb.ListSessionsResponse:
        async with observe_op("list"):
            req = parsed(request)
            owner = owner_of(context)
            page = await self._store.list_owned(
                owner, validation.check_page_size(req.page_size), req.page_token
            )
            return pb.ListSessionsResponse(
                sessions=[self._info(h) for h in page.sessions], next_page_token=page.next_page_token
            )

    async def TouchSession(
        self, request: pb.TouchSessionRequest | UndecodableRequest, context: Context
    ) -> pb.SessionInfo:
        async with observe_op("touch"):
            req = parsed(request)
            owner = owner_of(context)
            return self._info(await self._store.touch(owner, validation.check_session_id(req.session_id)))


def add_to_server(servicer: SessionServicer, server: grpc.aio.Server) -> None:
    """Like the generated ``add_SessionServicer_to_server``, with UTF-8-diagnosing deserializers."""
    methods: dict[str, tuple[Any, type[Message], type[Message]]] = {
        "CreateSession": (servicer.CreateSession, pb.CreateSessionRequest, pb.SessionInfo),
        "GetSession": (servicer.GetSession, pb.GetSessionRequest, pb.SessionState),
        "AppendTurns": (servicer.AppendTurns, pb.AppendTurnsRequest, pb.AppendTurnsResponse),
        "DeleteSession": (servicer.DeleteSession, pb.DeleteSessionRequest, pb.DeleteSessionResponse),
        "ListSessions": (servicer.ListSessions, pb.ListSessionsRequest, pb.ListSessionsResponse),
        "TouchSession": (servicer.TouchSession, pb.TouchSessionRequest, pb.SessionInfo),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            behavior,
            request_deserializer=tolerant_deserializer(request_type),
            response_serializer=response_type.SerializeToString,
        )
        for name, (behavior, request_type, response_type) in methods.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
