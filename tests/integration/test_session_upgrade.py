"""Sessions stored before sessions were keyed by owner, on a real Redis and a 3-node Cluster.

Until 2026-12-07 a session's keys were ``llm:session:{<id>}:*``, one namespace for all tenants.
Each tenant has its own now (services/session/keys.py); what the old layout holds must still be
its owner's after an upgrade (read, appended, listed, deleted), and must neither block nor show
through to any other tenant. The old layout is written here by hand, as the service wrote it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import pytest
import redis

from services.gen.llmmesh.v1 import session_pb2 as pb
from services.session.model import TurnRecord, request_digest
from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer
from tests.support.redis_cluster import RedisClusterServers
from tests.support.session_client import SessionClient, new_owner, rpc_error, turn

MAX_SESSIONS = 4


def legacy_key(session_id: str, part: str) -> str:
    """A key of the layout before 2026-12-07 (``meta``, ``turns``, ``requests``), spelled out here
    rather than taken from the service: it is what existing Redis data holds, whatever the code."""
    return f"llm:session:{{{session_id}}}:{part}"


def index_key(owner: str) -> str:
    return f"llm:owner:{{{owner}}}:sessions"


@dataclass
class Backend:
    service: ServiceProcess
    redis: redis.Redis | redis.RedisCluster


@pytest.fixture(scope="module", params=["redis", "redis-cluster"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    data = tmp_path_factory.mktemp(request.param)
    servers: RedisServer | RedisClusterServers
    client: redis.Redis | redis.RedisCluster
    if request.param == "redis":
        servers = RedisServer(data).start()
        flags = ["--redis-url", servers.url]
        client = redis.Redis.from_url(servers.url, decode_responses=True)
    else:
        servers = RedisClusterServers(data).start()
        flags = ["--redis-url", servers.url, "--redis-cluster"]
        client = redis.RedisCluster.from_url(servers.url, decode_responses=True)
    limits = ["--max-sessions-per-owner", str(MAX_SESSIONS)]
    service = ServiceProcess("services.session", [*flags, *limits])
    try:
        service.start(timeout=60)
        yield Backend(service, client)
        assert service.stop() == 0, service.output()
    finally:
        client.close()
        service.kill()
        if isinstance(servers, RedisServer):
            servers.kill()
        else:
            servers.stop()


@pytest.fixture()
async def channel(backend: Backend) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(backend.service.address) as ch:
        yield ch


def store_legacy(
    client: redis.Redis | redis.RedisCluster,
    owner: str,
    session_id: str,
    exchanges: list[tuple[str, str, str]],
    system_prompt: str = "",
    ttl: int = 600,
    created_at_ms: int | None = None,
) -> int:
    """A session as the service stored it before 2026-12-07: keys by id alone, owner inside.
    ``exchanges``: (request id, question, answer), one append each. Returns its created_at_ms."""
    created = created_at_ms or int(time.time() * 1000) - 60_000
    meta, turns_key, requests_key = (legacy_key(session_id, part) for part in ("meta", "turns", "requests"))
    client.hset(
        meta,
        mapping={
            "owner": owner,
            "system_prompt": system_prompt,
            "metadata": "{}",
            "version": str(len(exchanges)),
            "ttl": str(ttl),
            "created_at_ms": str(created),
            "updated_at_ms": str(created),
        },
    )
    client.expire(meta, ttl)
    for i, (request_id, question, answer) in enumerate(exchanges):
        pair = [TurnRecord("user", question), TurnRecord("assistant", answer)]
        for record in pair:
            stored = {"role": record.role, "content": record.content, "at": created, "req": request_id}
            client.rpush(turns_key, json.dumps(stored, separators=(",", ":")))
        client.hset(requests_key, request_id, f"{request_digest(pair)} {2 * i} 2")
    if exchanges:
        client.expire(turns_key, ttl)
        client.expire(requests_key, ttl)
    client.zadd(index_key(owner), {session_id: created})
    return created


def legacy_keys(client: redis.Redis | redis.RedisCluster, session_id: str) -> int:
    """How many of the id's old-layout keys are still there."""
    return sum(int(client.exists(legacy_key(session_id, part))) for part in ("meta", "turns", "requests"))


async def test_a_session_stored_before_the_upgrade_is_still_its_owners(
    backend: Backend, channel: grpc.aio.Channel
) -> None:
    acme = SessionClient(channel, new_owner())
    sid = f"old-{uuid.uuid4().hex[:6]}"
    created = store_legacy(
        backend.redis, acme.owner or "", sid, [("req-1", "My name is Ada.", "Hi Ada.")], "Be brief."
    )

    # Listed where it is (listing is not use: nothing moves).
    listed = (await acme.list()).sessions
    assert [(s.session_id, s.turn_count, s.version) for s in listed] == [(sid, 2, 1)]
    assert legacy_keys(backend.redis, sid) == 3

    state = await acme.get(sid)
    assert (state.info.owner, state.info.version, state.info.created_at_ms) == (acme.owner, 1, created)
    assert state.info.system_prompt == "Be brief."
    assert [(t.role, t.content, t.request_id) for t in state.turns] == [
        ("user", "My name is Ada.", "req-1"),
        ("assistant", "Hi Ada.", "req-1"),
    ]
    # Its first use moved it into its owner's keys, TTLs and all.
    assert legacy_keys(backend.redis, sid) == 0
    moved = [key for key in backend.redis.scan_iter(f"llm:session:{{{sid}}}:*")]
    assert len(moved) == 3 and all(0 < backend.redis.ttl(key) <= 600 for key in moved), moved

    # The request ids it stored still dedupe; versions and the creation time carry on.
    retry = await acme.append(sid, [turn("My name is Ada."), turn("Hello, Ada!", "assistant")], 0, "req-1")
    assert retry.duplicate and retry.version == 1
    follow_up = pb.AppendTurnsRequest(
        session_id=sid,
        turns=[turn("What is my name?"), turn("Ada.", "assistant")],
        expected_version=1,
        expected_created_at_ms=created,
        request_id="req-2",
    )
    assert (await acme.stub.AppendTurns(follow_up, **acme._kw())).version == 2
    assert (await rpc_error(acme.create(sid))).code() == grpc.StatusCode.ALREADY_EXISTS
    assert [(s.session_id, s.turn_count) for s in (await acme.list()).sessions] == [(sid, 4)]

    assert (await acme.delete(sid)).deleted
    assert (await rpc_error(acme.get(sid))).code() == grpc.StatusCode.NOT_FOUND
    assert list((await acme.list()).sessions) == []
    again = await acme.create(sid)
    assert (again.version, again.turn_count) == (0, 0)
    assert not (await acme.append(sid, [turn("new")], 0, "req-1")).duplicate


@pytest.mark.parametrize("first_use", ["append", "touch", "delete", "create", "retry"])
async def test_any_first_use_by_its_owner_finds_a_session_from_before_the_upgrade(
    backend: Backend, channel: grpc.aio.Channel, first_use: str
) -> None:
    acme = SessionClient(channel, new_owner())
    sid = f"old-{first_use}"
    created = store_legacy(backend.redis, acme.owner or "", sid, [("req-1", "q1", "a1")], ttl=300)
    if first_use == "append":
        request = pb.AppendTurnsRequest(
            session_id=sid, turns=[turn("q2")], expected_version=1, expected_created_at_ms=created
        )
        assert (await acme.stub.AppendTurns(request, **acme._kw())).info.turn_count == 3
    elif first_use == "retry":
        assert (await acme.append(sid, [turn("q1"), turn("other a1", "assistant")], None, "req-1")).duplicate
        reused = await rpc_error(acme.append(sid, [turn("another q")], None, "req-1"))
        assert reused.code() == grpc.StatusCode.ALREADY_EXISTS
    elif first_use == "touch":
        touched = await acme.touch(sid)
        assert (touched.turn_count, touched.ttl_seconds, touched.created_at_ms) == (2, 300, created)
    elif first_use == "delete":
        assert (await acme.delete(sid)).deleted
        assert (await rpc_error(acme.touch(sid))).code() == grpc.StatusCode.NOT_FOUND
        assert list((await acme.list()).sessions) == []
        assert legacy_keys(backend.redis, sid) == 0
        return
    else:
        assert (await rpc_error(acme.create(sid))).code() == grpc.StatusCode.ALREADY_EXISTS
    assert legacy_keys(backend.redis, sid) == 0
    state = await acme.get(sid)
    assert [t.content for t in state.turns][:2] == ["q1", "a1"] and state.info.created_at_ms == created
    assert [s.session_id for s in (await acme.list()).sessions] == [sid]


async def test_another_tenants_session_from_before_the_upgrade_neither_blocks_nor_shows(
    backend: Backend, channel: grpc.aio.Channel
) -> None:
    """globex's old-layout "shared" took the id from every tenant (PERMISSION_DENIED, for good)."""
    globex, acme = SessionClient(channel, new_owner()), SessionClient(channel, new_owner())
    store_legacy(backend.redis, globex.owner or "", "shared", [("g-1", "globex secret", "kept")], "G")
    fresh = await rpc_error(acme.get("never-used"))

    missing = await rpc_error(acme.get("shared"))
    assert (missing.code(), (missing.details() or "").replace("shared", "never-used")) == (
        fresh.code(),
        fresh.details(),
    )
    assert (await rpc_error(acme.touch("shared"))).code() == grpc.StatusCode.NOT_FOUND
    assert (await rpc_error(acme.append("shared", [turn("x")]))).code() == grpc.StatusCode.NOT_FOUND
    assert (await rpc_error(acme.delete("shared"))).code() == grpc.StatusCode.NOT_FOUND
    mine = await acme.create("shared", system_prompt="A")
    assert (mine.version, mine.turn_count, mine.system_prompt) == (0, 0, "A")
    await acme.append("shared", [turn("acme q"), turn("acme a", "assistant")], 0, "g-1")
    assert [t.content for t in (await acme.get("shared")).turns] == ["acme q", "acme a"]
    assert [s.system_prompt for s in (await acme.list()).sessions] == ["A"]
    assert legacy_keys(backend.redis, "shared") == 3  # acme moved nothing of globex's

    theirs = await globex.get("shared")
    assert theirs.info.system_prompt == "G" and [t.content for t in theirs.turns] == ["globex secret", "kept"]
    assert [s.system_prompt for s in (await globex.list()).sessions] == ["G"]
    assert [t.content for t in (await acme.get("shared")).turns] == ["acme q", "acme a"]


async def test_sessions_from_before_the_upgrade_count_against_their_owners_limit(
    backend: Backend, channel: grpc.aio.Channel
) -> None:
    acme = SessionClient(channel, new_owner())
    for i in range(MAX_SESSIONS - 1):
        store_legacy(backend.redis, acme.owner or "", f"limit-{i}-{acme.owner}", [])
    await acme.create()
    full = await rpc_error(acme.create())
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await acme.delete(f"limit-0-{acme.owner}")
    await acme.create()


async def test_concurrent_first_uses_move_a_session_once_and_lose_no_append(
    backend: Backend, channel: grpc.aio.Channel
) -> None:
    """Appends, reads and listings racing on a session from before the upgrade: the move is one
    step with whichever call comes first, so no append lands in the old layout after it, and no
    listing mistakes the session for gone (which would prune it from its owner's index)."""
    acme = SessionClient(channel, new_owner(), timeout=30)
    sid = "busy-old"
    store_legacy(backend.redis, acme.owner or "", sid, [("req-0", "q", "a")], created_at_ms=1_000)

    async def appender(n: int) -> None:
        await acme.append(sid, [turn(f"writer {n}")], request_id=f"w-{n}")

    async def lister() -> None:
        assert [s.session_id for s in (await acme.list()).sessions] == [sid]

    calls = (
        [appender(n) for n in range(20)] + [acme.get(sid) for _ in range(5)] + [lister() for _ in range(5)]
    )
    await asyncio.gather(*calls)
    state = await acme.get(sid)
    assert state.info.version == 21 and len(state.turns) == 22
    assert sorted(t.content for t in state.turns[2:]) == sorted(f"writer {n}" for n in range(20))
    assert legacy_keys(backend.redis, sid) == 0
    assert [s.session_id for s in (await acme.list()).sessions] == [sid]
