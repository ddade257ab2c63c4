"""SessionStore: sessions in Redis (single node or Cluster) through atomic Lua scripts.

Every session is keyed by its owner and its id (keys.py): each tenant has its own namespace of
ids, and nothing a tenant is told depends on the ids other tenants use. A session stored before
that (keyed by its id alone) is still its owner's: the first script its owner runs on it moves
it into the owner's keys (scripts._ADOPT), and listing reads it where it is.

Consistency across slots: a session's own keys share a hash tag, so every operation on one
session is one atomic script. The owner's index (for ListSessions and the per-owner limit)
lives in another slot and is updated by a separate call: a slot is reserved in the index
*before* the session is created and released *after* it is deleted, so the index is always a
superset of the owner's live sessions. Entries whose session has expired or failed to be
created are skipped by listing and pruned lazily.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from redis import exceptions as redis_errors
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript

from services.common import errors
from services.common.metadata import SESSION_VERSION_KEY
from services.session import keys, scripts
from services.session.limits import SessionLimits
from services.session.metrics import REDIS_LATENCY
from services.session.model import NewSession, SessionHeader, SessionPage, TurnRecord, request_digest

T = TypeVar("T")
RedisClient = Redis | RedisCluster

# What "Redis is down or slow" looks like from redis-py; all of it becomes UNAVAILABLE.
UNREACHABLE = (
    redis_errors.ConnectionError,  # includes BusyLoadingError while the AOF replays
    redis_errors.TimeoutError,
    redis_errors.ClusterDownError,
    redis_errors.ClusterError,
    redis_errors.RedisClusterException,
    redis_errors.TryAgainError,
    redis_errors.ReadOnlyError,  # a replica promoted mid-failover still refuses writes
    TimeoutError,
    OSError,
)

# Redis's own refusals of a write for want of room or health (maxmemory, a failed RDB save, a
# busy script, too few replicas): the store is unavailable, not the request wrong. They were
# INTERNAL, with Redis's message. Inside a script the reply comes wrapped ("Error running script
# … @user_script: 24: -OOM command not allowed …"), so it is looked for, not matched at the start.
UNAVAILABLE_REPLY = re.compile(r"(?:^|[\s-])(OOM|MISCONF|BUSY|NOREPLICAS|LOADING|MASTERDOWN)\b")

# An index entry younger than this may belong to a create still in flight, so pruning
# leaves it alone; far longer than any Redis round trip the timeout allows.
PRUNE_GRACE_MS = 30_000


def connect(url: str, *, cluster: bool, timeout_s: float, max_connections: int) -> RedisClient:
    """A pooled asyncio client that fails within ``timeout_s`` instead of hanging.

    No automatic retries: a script that ran but whose reply was lost must not run twice
    (an append would be duplicated); the caller sees UNAVAILABLE and can retry with
    expected_version.
    """
    common: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    if cluster:
        return RedisCluster.from_url(url, max_connections=max_connections, **common)
    pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout_s, **common)
    return Redis(connection_pool=pool, retry=Retry(NoBackoff(), 0))


@dataclass(frozen=True)
class SessionRead:
    """What one GetSession read: the header, a window's turns and where they end."""

    header: SessionHeader
    #: The newest turns asked for, oldest first, ending at ``stop``.
    turns: list[TurnRecord]
    #: The turns the asked-for request stored (empty when none or not asked).
    request_turns: list[TurnRecord]
    #: The index past the window's last turn: the turn count, or the request's first turn.
    stop: int

    @property
    def holds_request(self) -> bool:
        return bool(self.request_turns)


def _pairs(flat: Sequence[str]) -> dict[str, str]:
    return dict(zip(flat[0::2], flat[1::2], strict=True))


def encode_turn(turn: TurnRecord) -> str:
    record: dict[str, Any] = {"role": turn.role, "content": turn.content, "at": turn.created_at_ms}
    if turn.token_count is not None:
        record["tokens"] = turn.token_count
    if turn.metadata:
        record["meta"] = dict(turn.metadata)
    if turn.request_id:
        record["req"] = turn.request_id
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


def decode_turn(raw: str) -> TurnRecord:
    record = json.loads(raw)
    return TurnRecord(
        role=record["role"],
        content=record["content"],
        token_count=record.get("tokens"),
        created_at_ms=int(record.get("at", 0)),
        metadata=record.get("meta", {}),
        request_id=record.get("req", ""),
    )


def decode_header(session_id: str, fields: Mapping[str, str], turn_count: int) -> SessionHeader:
    return SessionHeader(
        session_id=session_id,
        owner=fields["owner"],
        system_prompt=fields.get("system_prompt", ""),
        metadata=json.loads(fields.get("metadata") or "{}"),
        version=int(fields.get("version", 0)),
        turn_count=int(turn_count),
        ttl_seconds=int(fields["ttl"]),
        created_at_ms=int(fields.get("created_at_ms", 0)),
        updated_at_ms=int(fields.get("updated_at_ms", 0)),
    )


def encode_page_token(score: str, session_id: str) -> str:
    """The cursor after (creation ms, id); scores are whole milliseconds."""
    return base64.urlsafe_b64encode(f"{int(float(score))}|{session_id}".encode()).decode()


def decode_page_token(token: str) -> tuple[str, str]:
    try:
        score, session_id = base64.urlsafe_b64decode(token.encode()).decode().split("|", 1)
        # ASCII digits only: str.isdigit takes "²" and other scripts' digits, which Redis then
        # refused inside the page script (INTERNAL, with the script's text).
        if not (score.isascii() and score.isdigit()) or len(score) > 16:
            raise ValueError(score)
    except (ValueError, binascii.Error, UnicodeError) as exc:
        raise errors.InvalidArgument("page_token", "is not a token from a previous response") from exc
    return score, session_id


class SessionStore:
    """Conversation state for many owners, with sliding TTLs and optimistic versions."""

    def __init__(
        self,
        client: RedisClient,
        limits: SessionLimits,
        timeout_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._limits = limits
        self._timeout_s = timeout_s
        self._clock = clock
        register = client.register_script
        self._create: AsyncScript = register(scripts.CREATE)
        self._get: AsyncScript = register(scripts.GET)
        self._append: AsyncScript = register(scripts.APPEND)
        self._touch: AsyncScript = register(scripts.TOUCH)
        self._delete: AsyncScript = register(scripts.DELETE)
        self._reserve: AsyncScript = register(scripts.RESERVE)
        self._page: AsyncScript = register(scripts.PAGE)
        self._release: AsyncScript = register(scripts.RELEASE)

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    async def _redis(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        """One bounded Redis round trip: UNAVAILABLE within the timeout if Redis is down or slow."""
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self._timeout_s):
                return await call()
        except UNREACHABLE as exc:
            raise errors.DependencyUnavailable(
                f"session store unavailable during {op}: {type(exc).__name__}: {exc or 'timed out'}"
            ) from exc
        except redis_errors.ResponseError as exc:
            # redis-py turns some replies into their own classes and drops the reply's code from
            # the message ("command not allowed when used memory > 'maxmemory'"), so both count.
            found = UNAVAILABLE_REPLY.search(str(exc))
            reply = "OOM" if isinstance(exc, redis_errors.OutOfMemoryError) else found[1] if found else None
            if reply is None:
                raise
            raise errors.DependencyUnavailable(f"session store unavailable during {op}: {reply}") from exc
        finally:
            REDIS_LATENCY.labels(op).observe(time.perf_counter() - started)

    async def _session_script(
        self, op: str, script: AsyncScript, owner: str, session_id: str, *args: Any
    ) -> list[Any]:
        """Runs a per-session script on ``owner``'s session ``session_id`` (ARGV[1] is the owner).

        Never PERMISSION_DENIED: another tenant's session under the id lives under other keys
        and is not this caller's to know of, so all the caller can be told is about its own.
        """
        keys_ = keys.script_keys(owner, session_id)
        reply: list[Any] = await self._redis(op, lambda: script(keys=keys_, args=[owner, *args]))
        status = reply[0]
        if status == "missing":
            raise errors.NotFound(f"session {session_id!r} not found (never created, deleted or expired)")
        if status == "collision":
            # Two owners whose 128-bit key digests collide: not served, and loud.
            raise errors.MeshError(
                f"session {session_id!r}: the stored session's owner does not match its keys"
            )
        return reply

    async def ping(self) -> None:
        """Raises DependencyUnavailable unless Redis (every primary, on a cluster) answers."""
        client = self._client
        if isinstance(client, RedisCluster):
            await self._redis("ping", lambda: client.ping(target_nodes=RedisCluster.PRIMARIES))
        else:
            await self._redis("ping", client.ping)

    async def create(self, new: NewSession) -> SessionHeader:
        await self._reserve_index_slot(new.owner, new.session_id)
        reply = await self._session_script(
            "create",
            self._create,
            new.owner,
            new.session_id,
            new.system_prompt,
            json.dumps(dict(new.metadata), ensure_ascii=False),
            new.ttl_seconds,
            self._now_ms(),
        )
        if reply[0] == "exists":
            # The caller's own session (another owner's is in another namespace), so the index
            # entry the reservation found or made is rightly there: nothing to undo.
            raise errors.AlreadyExists(f"session {new.session_id!r} already exists")
        header = decode_header(new.session_id, _pairs(reply[1]), reply[2])
        # The entry as of this creation: one an expired session under the id left keeps its old
        # place until now, and a listing may have pruned it meanwhile (the session was gone).
        index = keys.owner_index_key(new.owner)
        await self._redis(
            "index_place", lambda: self._client.zadd(index, {new.session_id: header.created_at_ms})
        )
        return header

    async def get(
        self, owner: str, session_id: str, max_turns: int = 0, before_request_id: str = ""
    ) -> SessionRead:
        """The header and the newest ``max_turns`` turns (all for 0); refreshes the TTL.

        With ``before_request_id`` that the session stored, the turns are the newest before that
        request's own, which come apart (``SessionRead.request_turns``).
        """
        reply = await self._session_script("get", self._get, owner, session_id, max_turns, before_request_id)
        header = decode_header(session_id, _pairs(reply[1]), reply[2])
        return SessionRead(
            header,
            [decode_turn(raw) for raw in reply[3]],
            [decode_turn(raw) for raw in reply[4]],
            int(reply[5]),
        )

    async def append(
        self,
        owner: str,
        session_id: str,
        turns: Sequence[TurnRecord],
        expected_version: int | None,
        request_id: str = "",
        expected_created_at_ms: int | None = None,
    ) -> tuple[SessionHeader, bool]:
        """Stores all ``turns`` or none; ABORTED when ``expected_version`` is stale.

        Returns the header and whether ``request_id`` had been stored already, in which case
        nothing was stored this time (whatever ``expected_version`` said).
        """
        now = self._now_ms()
        stamped = [
            encode_turn(TurnRecord(t.role, t.content, t.token_count, now, t.metadata, request_id))
            for t in turns
        ]
        expected = "" if expected_version is None else str(expected_version)
        if expected and expected_created_at_ms is not None:
            expected += f"@{expected_created_at_ms}"
        reply = await self._session_script(
            "append",
            self._append,
            owner,
            session_id,
            expected,
            now,
            self._limits.max_turns_per_session,
            request_id,
            request_digest(turns),
            *stamped,
        )
        if reply[0] == "duplicate":
            return decode_header(session_id, _pairs(reply[1]), reply[2]), True
        if reply[0] == "reused":
            raise errors.AlreadyExists(
                f"request_id: {request_id!r} already appended other turns to session {session_id!r}; "
                "send a new one"
            )
        if reply[0] == "recreated":
            raise errors.Conflict(
                f"session {session_id!r} was deleted and created again since it was read "
                f"(now at version {reply[1]})",
                trailing=((SESSION_VERSION_KEY, str(reply[1])),),
            )
        if reply[0] == "conflict":
            current = reply[1]
            raise errors.Conflict(
                f"session {session_id!r} is at version {current}, not the expected {expected}",
                trailing=((SESSION_VERSION_KEY, str(current)),),
            )
        if reply[0] == "full":
            raise errors.LimitExceeded(
                f"session {session_id!r} holds {reply[1]} turns; appending {len(turns)} would exceed "
                f"the limit of {self._limits.max_turns_per_session}"
            )
        return decode_header(session_id, _pairs(reply[1]), reply[2]), False

    async def touch(self, owner: str, session_id: str) -> SessionHeader:
        reply = await self._session_script("touch", self._touch, owner, session_id)
        return decode_header(session_id, _pairs(reply[1]), reply[2])

    async def delete(self, owner: str, session_id: str) -> None:
        reply = await self._session_script("delete", self._delete, owner, session_id)
        await self._release_index(owner, session_id, reply[1])

    async def _release_index(self, owner: str, session_id: str, created_at_ms: str) -> None:
        """Free a deleted session's index entry, unless a new session under its id holds it now."""
        index = keys.owner_index_key(owner)
        if not created_at_ms:
            return  # a session from before created_at_ms: listing prunes its entry lazily
        await self._redis(
            "index_release", lambda: self._release(keys=[index], args=[session_id, created_at_ms])
        )

    async def list_owned(self, owner: str, page_size: int, page_token: str) -> SessionPage:
        """The owner's live sessions in creation order, one page at a time."""
        after_score, after_id = decode_page_token(page_token) if page_token else ("", "")
        index = keys.owner_index_key(owner)
        # One row more than asked tells whether another page follows.
        flat: list[str] = await self._redis(
            "index_page", lambda: self._page(keys=[index], args=[after_score, after_id, page_size + 1])
        )
        rows = list(zip(flat[0::2], flat[1::2], strict=True))
        page, more = rows[:page_size], len(rows) > page_size
        headers = await self._headers(owner, [session_id for session_id, _ in page])
        live: list[SessionHeader] = []
        stale: list[str] = []
        cutoff = self._now_ms() - PRUNE_GRACE_MS
        for (session_id, score), header in zip(page, headers, strict=True):
            if header is not None:
                live.append(header)
            elif float(score) < cutoff:
                stale.append(session_id)
        if stale:
            await self._redis("index_prune", lambda: self._client.zrem(index, *stale))
        token = encode_page_token(page[-1][1], page[-1][0]) if more else ""
        return SessionPage(tuple(live), token)

    async def _headers(self, owner: str, session_ids: Sequence[str]) -> list[SessionHeader | None]:
        """Headers of ``owner``'s sessions (any slots), pipelined; None where it has none (gone).

        A session still in the layout from before owners had keys of their own is read where it
        is, if it is the owner's (listing is not use: it moves nothing); one more round trip,
        for the ids not found under the owner's keys only.
        """
        found = await self._fetch_headers(
            "headers",
            [
                [(session_id, keys.meta_key(owner, session_id), keys.turns_key(owner, session_id))]
                for session_id in session_ids
            ],
        )
        missing = [i for i, header in enumerate(found) if header is None]
        if missing:
            # The old layout first, then the owner's keys again: a call moving the session over
            # meanwhile (scripts._ADOPT, atomic) cannot hide it from both reads, and a live
            # session that both missed would be pruned from the index as gone.
            again = await self._fetch_headers(
                "legacy_headers",
                [
                    [
                        (sid, keys.legacy_meta_key(sid), keys.legacy_turns_key(sid)),
                        (sid, keys.meta_key(owner, sid), keys.turns_key(owner, sid)),
                    ]
                    for sid in (session_ids[i] for i in missing)
                ],
            )
            for i, header in zip(missing, again, strict=True):
                found[i] = header
        # Under the owner's keys the owner always matches (but for a digest collision); an
        # old-layout session under the id may be anyone's.
        return [header if header is not None and header.owner == owner else None for header in found]

    async def _fetch_headers(
        self, op: str, places: Sequence[Sequence[tuple[str, str, str]]]
    ) -> list[SessionHeader | None]:
        """One header per entry of ``places`` in one pipelined round trip: each entry's
        (session id, meta key, turns key) are read in order and the last one found wins."""
        rows = [row for entry in places for row in entry]
        if not rows:
            return []

        async def fetch() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for _, meta, turns in rows:
                pipe.hgetall(meta)
                pipe.llen(turns)
            return list(await pipe.execute())

        replies = iter(await self._redis(op, fetch))
        headers: list[SessionHeader | None] = []
        for entry in places:
            header: SessionHeader | None = None
            for session_id, _, _ in entry:
                fields, count = next(replies), next(replies)
                if fields:
                    header = decode_header(session_id, fields, count)
            headers.append(header)
        return headers

    async def _reserve_index_slot(self, owner: str, session_id: str) -> None:
        index = keys.owner_index_key(owner)
        limit = self._limits.max_sessions_per_owner

        async def reserve() -> bool:
            return bool(await self._reserve(keys=[index], args=[session_id, self._now_ms(), limit]))

        if await self._redis("index_reserve", reserve):
            return
        # Full: expired sessions may still hold entries, so prune them and try once more.
        await self._prune(owner)
        if not await self._redis("index_reserve", reserve):
            raise errors.LimitExceeded(f"owner already holds the maximum of {limit} sessions")

    async def _prune(self, owner: str) -> None:
        index = keys.owner_index_key(owner)
        rows = cast(
            list[tuple[str, float]],
            await self._redis("index_scan", lambda: self._client.zrange(index, 0, -1, withscores=True)),
        )
        cutoff = self._now_ms() - PRUNE_GRACE_MS
        old = [session_id for session_id, score in rows if score < cutoff]
        headers = await self._headers(owner, old)
        stale = [sid for sid, header in zip(old, headers, strict=True) if header is None]
        if stale:
            await self._redis("index_prune", lambda: self._client.zrem(index, *stale))

    async def close(self) -> None:
        await self._client.aclose()
