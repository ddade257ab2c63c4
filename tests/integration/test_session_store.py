"""SessionStore on a real Redis: the owner index stays a superset of live sessions and heals itself."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis import exceptions as redis_exceptions

from services.common import errors
from services.common.metadata import TENANT_KEY
from services.gen.llmmesh.v1 import session_pb2 as pb
from services.session import keys
from services.session.limits import SessionLimits
from services.session.model import NewSession, TurnRecord
from services.session.servicer import SessionServicer
from services.session.store import PRUNE_GRACE_MS, SessionStore, connect
from services.session.window import TURN_OVERHEAD_TOKENS, select_window
from tests.support.redis import RedisServer


class SteppedClock:
    """A wall clock the test moves by hand (Redis TTLs still run on real time)."""

    def __init__(self, now_s: float = 1_800_000_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture()
async def store_and_clock(redis_server: RedisServer) -> AsyncIterator[tuple[SessionStore, SteppedClock]]:
    clock = SteppedClock()
    client = connect(redis_server.url, cluster=False, timeout_s=1.0, max_connections=8)
    store = SessionStore(client, SessionLimits(max_sessions_per_owner=2), timeout_s=1.0, clock=clock)
    yield store, clock
    await store.close()


def new(session_id: str, owner: str = "acme") -> NewSession:
    return NewSession(session_id=session_id, owner=owner, system_prompt="", metadata={}, ttl_seconds=600)


async def vanish(store: SessionStore, session_id: str, owner: str = "acme") -> None:
    """What expiry does: the session's keys disappear while its index entry stays."""
    await store._client.delete(keys.meta_key(owner, session_id), keys.turns_key(owner, session_id))


async def test_an_expired_session_frees_its_owners_place_once_past_the_grace(
    store_and_clock: tuple[SessionStore, SteppedClock],
) -> None:
    store, clock = store_and_clock
    await store.create(new("a"))
    await store.create(new("b"))
    await vanish(store, "a")
    with pytest.raises(errors.LimitExceeded):  # "a" may still be a create in flight: not pruned yet
        await store.create(new("c"))
    clock.now_s += PRUNE_GRACE_MS / 1000 + 1
    await store.create(new("c"))
    page = await store.list_owned("acme", page_size=10, page_token="")
    assert [h.session_id for h in page.sessions] == ["b", "c"]


async def test_listing_skips_and_prunes_entries_whose_session_is_gone_even_if_another_owner_uses_its_id(
    store_and_clock: tuple[SessionStore, SteppedClock],
) -> None:
    store, clock = store_and_clock
    await store.create(new("mine"))
    await store.create(new("reused"))
    await vanish(store, "reused")
    await store.create(new("reused", owner="other"))  # same id, another owner's own session
    clock.now_s += PRUNE_GRACE_MS / 1000 + 1
    page = await store.list_owned("acme", page_size=10, page_token="")
    assert [h.session_id for h in page.sessions] == ["mine"]
    assert await store._client.zrange(keys.owner_index_key("acme"), 0, -1) == ["mine"]


async def test_append_is_all_or_nothing_at_the_turn_limit(redis_server: RedisServer) -> None:
    client = connect(redis_server.url, cluster=False, timeout_s=1.0, max_connections=8)
    store = SessionStore(client, SessionLimits(max_turns_per_session=3), timeout_s=1.0)
    try:
        await store.create(new("s"))
        await store.append("acme", "s", [TurnRecord("user", "1"), TurnRecord("assistant", "2")], 0)
        with pytest.raises(errors.LimitExceeded):
            await store.append("acme", "s", [TurnRecord("user", "3"), TurnRecord("assistant", "4")], 1)
        read = await store.get("acme", "s")
        assert read.header.version == 1 and [t.content for t in read.turns] == ["1", "2"]
    finally:
        await store.close()


async def test_request_ids_expire_with_their_session_and_go_with_its_deletion(
    redis_server: RedisServer,
) -> None:
    client = connect(redis_server.url, cluster=False, timeout_s=1.0, max_connections=8)
    store = SessionStore(client, SessionLimits(), timeout_s=1.0)
    try:
        await store.create(new("kept"))
        header, duplicate = await store.append("acme", "kept", [TurnRecord("user", "hi")], None, "req-1")
        assert (header.version, duplicate) == (1, False)
        # Left without a TTL, a session's request ids would outlive it in Redis forever.
        assert 0 < await client.ttl(keys.requests_key("acme", "kept")) <= 600
        await store.delete("acme", "kept")
        assert not await client.exists(keys.requests_key("acme", "kept"))
    finally:
        await store.close()


async def test_a_full_redis_is_unavailable_not_internal(redis_server: RedisServer) -> None:
    """Redis at its maxmemory refuses writes with OOM: that was INTERNAL, Redis's message and all."""
    client = connect(redis_server.url, cluster=False, timeout_s=1.0, max_connections=8)
    store = SessionStore(client, SessionLimits(), timeout_s=1.0)
    try:
        await store.create(new("full"))
        await client.config_set("maxmemory", 1)  # a byte: every write is over it
        with pytest.raises(errors.DependencyUnavailable, match="unavailable during append: OOM"):
            await store.append("acme", "full", [TurnRecord("user", "hi")], None)
        # Refused before its script runs (not cached yet: EVAL itself), redis-py raises its own
        # OutOfMemoryError, whose message lacks the reply's "OOM": the same answer.
        await client.script_flush()
        with pytest.raises(errors.DependencyUnavailable, match="unavailable during append: OOM"):
            await store.append("acme", "full", [TurnRecord("user", "hi")], None)
        await client.config_set("maxmemory", 0)
        header, _ = await store.append("acme", "full", [TurnRecord("user", "hi")], None)
        assert header.turn_count == 1  # the refused append left nothing behind
    finally:
        await store.close()


class _Context:
    """The little of a gRPC servicer context GetSession reads: the caller's tenant."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TENANT_KEY, "acme"),)


async def test_a_budgeted_read_takes_only_the_turns_the_budget_could_hold(redis_server: RedisServer) -> None:
    """Each turn costs the template's 5 tokens at least, so a 100-token window holds 20 turns at
    most: a 600-turn session was read whole (every turn's bytes through Redis) for each turn."""
    fetched: list[int] = []

    class Recording(SessionStore):
        async def get(
            self, owner: str, session_id: str, max_turns: int = 0, before_request_id: str = ""
        ) -> Any:
            read = await super().get(owner, session_id, max_turns, before_request_id)
            fetched.append(len(read.turns))
            return read

    client = connect(redis_server.url, cluster=False, timeout_s=1.0, max_connections=8)
    store = Recording(client, SessionLimits(), timeout_s=1.0)
    servicer = SessionServicer(store, SessionLimits())
    try:
        await store.create(new("long"))
        turns = [TurnRecord("user" if i % 2 == 0 else "assistant", f"turn {i}") for i in range(600)]
        await store.append("acme", "long", turns, None)
        budgeted = await servicer.GetSession(
            pb.GetSessionRequest(session_id="long", token_budget=100), _Context()
        )
        assert fetched == [100 // TURN_OVERHEAD_TOKENS]
        # The same window as one chosen from the whole history.
        whole = await store.get("acme", "long")
        expected, _ = select_window("", whole.turns, token_budget=100)
        assert [t.content for t in budgeted.turns] == [t.content for t in expected] != []
        assert budgeted.omitted_turns == 600 - len(expected)
        assert budgeted.turns[0].role == "user"
    finally:
        await store.close()


async def test_a_delete_racing_a_create_of_the_same_id_leaves_the_new_session_listed(
    redis_server: RedisServer,
) -> None:
    """The delete frees the index entry after the session's keys are gone; a create of the same id
    landing between the two had its entry removed: a live session ListSessions never showed and
    the per-owner limit did not count."""

    class Racing(SessionStore):
        async def _release_index(self, owner: str, session_id: str, created_at_ms: str) -> None:
            self._clock = lambda: 1_800_000_100.0  # the new session is created a little later
            await self.create(new(session_id))  # lands between the delete and its release
            await super()._release_index(owner, session_id, created_at_ms)

    client = connect(redis_server.url, cluster=False, timeout_s=1.0, max_connections=8)
    store = Racing(
        client, SessionLimits(max_sessions_per_owner=2), timeout_s=1.0, clock=lambda: 1_800_000_000.0
    )
    try:
        await store.create(new("raced"))
        await store.delete("acme", "raced")
        assert (await store.get("acme", "raced")).header.session_id == "raced"  # the new one lives
        page = await store.list_owned("acme", 10, "")
        assert [h.session_id for h in page.sessions] == ["raced"]
    finally:
        await store.close()


async def test_redis_py_s_own_out_of_memory_error_is_unavailable_too(redis_server: RedisServer) -> None:
    """redis-py may raise its OutOfMemoryError with the reply's "OOM" cut off the message (seen on
    a clean checkout): matched by its text alone, it was INTERNAL."""
    client = connect(redis_server.url, cluster=False, timeout_s=1.0, max_connections=8)
    store = SessionStore(client, SessionLimits(), timeout_s=1.0)

    async def refused() -> None:
        raise redis_exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")

    try:
        with pytest.raises(errors.DependencyUnavailable, match="unavailable during append: OOM"):
            await store._redis("append", refused)
    finally:
        await store.close()


async def test_a_session_under_the_callers_keys_with_another_owner_is_never_served(
    redis_server: RedisServer,
) -> None:
    """Only two owners whose 128-bit key digests collide could get there (keys.py): refused as
    INTERNAL, never PERMISSION_DENIED (which no tenant's session gives any more) nor served."""
    client = connect(redis_server.url, cluster=False, timeout_s=1.0, max_connections=8)
    store = SessionStore(client, SessionLimits(), timeout_s=1.0)
    try:
        await store.create(new("s", owner="globex"))
        await client.rename(keys.meta_key("globex", "s"), keys.meta_key("acme", "s"))
        for call in (store.get("acme", "s"), store.touch("acme", "s"), store.delete("acme", "s")):
            with pytest.raises(errors.MeshError) as refused:
                await call
            assert refused.value.code == errors.Code.INTERNAL and "does not match" in str(refused.value)
        with pytest.raises(errors.MeshError) as refused:
            await store.append("acme", "s", [TurnRecord("user", "hi")], None)
        assert refused.value.code == errors.Code.INTERNAL
        assert await client.exists(keys.meta_key("acme", "s"))  # and nothing deleted
    finally:
        await store.close()
