"""Durable async tasks in Redis: create, read, move and follow tasks, and the shared work queue.

Where each piece lives is in ``keys.py``, the scripts that change a task
atomically in ``scripts.py``, the record and its serialisation in ``record.py``.

Admission happens in the script that creates the task: a tenant at its cap of
unfinished tasks, or a work queue holding ``max_queued`` entries, is refused
(``errors.Overloaded``: RESOURCE_EXHAUSTED) and nothing is stored. The queue is
never trimmed, so an accepted task is never dropped to make room.

Blocking reads (XREAD/XREADGROUP … BLOCK) are shielded from cancellation: a
read cancelled mid-block leaves its connection mid-reply, and redis-py then
closes it under the pool lock, stalling every other Redis call of the router
(for up to ``socket_connect_timeout``, forever when that is unset). Shielded,
the read finishes within its BLOCK time and returns its connection cleanly.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from services.common import errors
from services.gen.llmmesh.v1 import router_pb2
from services.router.admission.auth import Principal
from services.router.tasks.keys import (
    CLUSTER_KEYS,
    EVENT_KIND,
    EVENT_PAYLOAD,
    GROUP,
    STANDALONE_KEYS,
    TaskKeys,
)
from services.router.tasks.record import (
    STATUS_FIELDS,
    TERMINAL_STATES,
    TaskRecord,
    now_ms,
    pack_token_ids,
    status_hash,
)
from services.router.tasks.scripts import (
    APPEND_DELTA_LUA,
    CREATE_LUA,
    HAND_BACK_LUA,
    HEARTBEAT_LUA,
    RUN_HSET_LUA,
    TRANSITION_LUA,
)

#: ``transition``'s state when another run owns the task (nothing changed).
SUPERSEDED = -2


class Superseded(Exception):
    """Another run owns the task now (it was taken over): this run must stop, writing nothing."""


class TaskRefused(errors.Overloaded):
    """A submission refused at admission (RESOURCE_EXHAUSTED): ``reason`` is tenant_cap or queue_full."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class TaskStore:
    """Task records, events and the work queue in Redis."""

    def __init__(
        self,
        redis: Any,
        result_ttl_s: int = 600,
        unfinished_ttl_s: int = 86_400,
        events_maxlen: int = 10_000,
        max_open_per_tenant: int = 1000,
        max_queued: int = 100_000,
        max_open_bytes_per_tenant: int = 256 * 1024 * 1024,
        keys: TaskKeys | None = None,
    ) -> None:
        if result_ttl_s < 1:
            raise ValueError(f"result_ttl_s: must be >= 1, got {result_ttl_s}")
        if max_open_per_tenant < 0 or max_queued < 0 or max_open_bytes_per_tenant < 0:
            raise ValueError("task caps must be >= 0 (0 = no cap)")
        self.redis = redis
        # The layout follows the client unless given: a Redis Cluster needs the one-slot layout.
        self.keys = keys or (CLUSTER_KEYS if isinstance(redis, RedisCluster) else STANDALONE_KEYS)
        self.result_ttl_s = result_ttl_s
        # A task nobody ever finishes (all routers gone for a day) must not live forever.
        self.unfinished_ttl_s = unfinished_ttl_s
        self.events_maxlen = events_maxlen
        #: Unfinished (queued or running) tasks one tenant may have; 0 = no cap.
        self.max_open_per_tenant = max_open_per_tenant
        #: Bytes of requests one tenant's unfinished tasks may hold together; 0 = no cap.
        self.max_open_bytes_per_tenant = max_open_bytes_per_tenant
        #: Entries the work queue may hold (every unfinished task of every tenant); 0 = no cap.
        self.max_queued = max_queued
        self._create = redis.register_script(CREATE_LUA)
        self._transition = redis.register_script(TRANSITION_LUA)
        self._append_delta = redis.register_script(APPEND_DELTA_LUA)
        self._run_hset = redis.register_script(RUN_HSET_LUA)
        self._heartbeat = redis.register_script(HEARTBEAT_LUA)
        self._hand_back = redis.register_script(HAND_BACK_LUA)

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.keys.stream, GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def create(
        self,
        principal: Principal,
        request: router_pb2.ChatRequest,
        task_id: str | None = None,
        idempotency_key: str = "",
    ) -> TaskRecord | str:
        """Store a QUEUED task and put it on the work queue, atomically; ``TaskRefused`` (nothing
        stored) when the tenant has ``max_open_per_tenant`` unfinished tasks or the queue is full.

        With ``idempotency_key``: the id of the tenant's task already submitted under it while
        that task is still stored (nothing created), else the new task, the key now naming it.
        """
        task_id = task_id or uuid.uuid4().hex
        now = now_ms()
        record = TaskRecord(
            task_id=task_id,
            state=router_pb2.TASK_STATE_QUEUED,
            tenant=principal.tenant,
            key_id=principal.key_id,
            limits=principal.limits,
            request=request.SerializeToString(),
            created_ms=now,
            updated_ms=now,
            result_ttl_s=self.result_ttl_s,
        )
        limits = {k: v for k, v in vars(principal.limits).items() if v is not None}
        fields: dict[str, str | int | bytes] = {
            "state": record.state,
            "tenant": record.tenant,
            "key_id": record.key_id,
            "limits": json.dumps(limits),
            "request": record.request,
            "created_ms": now,
            "updated_ms": now,
            "attempts": 0,
        }
        args: list[Any] = [
            now,
            self.unfinished_ttl_s,
            self.events_maxlen,
            self.max_open_per_tenant,
            self.max_queued,
            task_id,
            record.to_proto().SerializeToString(),
            *self.keys.task("\n").split("\n"),  # a task's hash key around its id
            len(record.request),
            self.max_open_bytes_per_tenant,
        ]
        for name, value in fields.items():
            args += [name, value]
        keys = [
            self.keys.task(task_id),
            self.keys.events(task_id),
            self.keys.stream,
            self.keys.open_tasks(principal.tenant),
            self.keys.open_bytes(principal.tenant),
        ]
        if idempotency_key:
            keys.append(self.keys.idempotency(principal.tenant, idempotency_key))
        created, reason, count = await self._create(keys=keys, args=args)
        if created:
            return record
        if int(reason) == 3:
            return count.decode() if isinstance(count, bytes) else str(count)
        if int(reason) == 1:
            raise TaskRefused(
                f"tenant {principal.tenant!r} has {int(count)} unfinished tasks (max {self.max_open_per_tenant}):"
                " wait for some to finish, or cancel some",
                "tenant_cap",
            )
        if int(reason) == 4:
            raise TaskRefused(
                f"tenant {principal.tenant!r} has {int(count):,} bytes of unfinished task requests; this "
                f"one's {len(record.request):,} would pass the limit of {self.max_open_bytes_per_tenant:,}:"
                " wait for some to finish, or cancel some",
                "tenant_bytes",
            )
        raise TaskRefused(
            f"task queue full: {int(count)} tasks queued or running (max {self.max_queued}); retry later",
            "queue_full",
        )

    async def open_tasks(self, tenant: str) -> int:
        """The tenant's unfinished tasks, as counted against ``max_open_per_tenant``."""
        return int(await self.redis.zcard(self.keys.open_tasks(tenant)))

    async def get(self, task_id: str, *, with_resume_state: bool = False) -> TaskRecord | None:
        """The task; its request, checkpoint and token ids only when asked (the worker running it), not on every GetTask."""
        pipe = self.redis.pipeline(transaction=True)
        if not with_resume_state:
            self._read_status(pipe, task_id)
            return self._status_record(task_id, *await pipe.execute())
        pipe.hgetall(self.keys.task(task_id))
        pipe.get(self.keys.text(task_id))
        pipe.get(self.keys.tokens(task_id))
        raw, text, tokens = await pipe.execute()
        return TaskRecord.from_hash(task_id, raw, text, self.result_ttl_s, tokens) if raw else None

    async def snapshot(self, task_id: str) -> tuple[TaskRecord | None, str]:
        """The task and the id of its latest event, read together, so a watcher misses nothing and sees nothing twice."""
        pipe = self.redis.pipeline(transaction=True)
        self._read_status(pipe, task_id)
        pipe.xrevrange(self.keys.events(task_id), count=1)
        values, text, last = await pipe.execute()
        record = self._status_record(task_id, values, text)
        if record is None:
            return None, "0-0"
        return record, last[0][0].decode() if last else "0-0"

    def _read_status(self, pipe: Any, task_id: str) -> None:
        """Queue the reads of a client's view of a task: its status fields and its text so far."""
        pipe.hmget(self.keys.task(task_id), STATUS_FIELDS)
        pipe.get(self.keys.text(task_id))

    def _status_record(
        self, task_id: str, values: list[bytes | None], text: bytes | None
    ) -> TaskRecord | None:
        raw = status_hash(values)
        return TaskRecord.from_hash(task_id, raw, text, self.result_ttl_s) if raw else None

    async def transition(
        self,
        record: TaskRecord,
        allowed_from: frozenset[int] | set[int],
        new_state: int,
        *,
        end: bytes = b"",
        error: str = "",
        reset_text: bool = False,
        extra: dict[str, str | int] | None = None,
        run: str = "",
    ) -> tuple[int, bool]:
        """Move the task to ``new_state`` if it is in one of ``allowed_from``; returns (state now, changed).

        ``run``: the run that must own the task ("" = any); another's: (``SUPERSEDED``, False).
        """
        now = now_ms()
        record.state, record.updated_ms = new_state, now
        if reset_text:
            record.text = ""
        if end:
            record.end = end
        if error:
            record.error = error
        fields: dict[str, str | int | bytes] = dict(extra or {})
        if end:
            fields["end"] = end
        if error:
            fields["error"] = error
        ttl = self.result_ttl_s if new_state in TERMINAL_STATES else 0
        args: list[Any] = [
            " ".join(str(s) for s in sorted(allowed_from)),
            new_state,
            now,
            record.to_proto().SerializeToString(),
            ttl,
            self.events_maxlen,
            "1" if reset_text else "0",
            record.task_id,
            run,
        ]
        for k, v in fields.items():
            args += [k, v]
        keys = [
            self.keys.task(record.task_id),
            self.keys.events(record.task_id),
            self.keys.text(record.task_id),
            self.keys.open_tasks(record.tenant),
            self.keys.tokens(record.task_id),
            self.keys.open_bytes(record.tenant),
        ]
        state, changed = await self._transition(keys=keys, args=args)
        return int(state), bool(changed)

    async def append_delta(self, task_id: str, delta: router_pb2.TokenDelta, run: str = "") -> None:
        """Append a delta to the task's text, token ids and events, in one step; ``Superseded``
        (nothing written) when ``run`` no longer owns the task ("" = any run)."""
        keys = [
            self.keys.task(task_id),
            self.keys.text(task_id),
            self.keys.tokens(task_id),
            self.keys.events(task_id),
        ]
        args = [
            run,
            delta.text.encode(),
            pack_token_ids(delta.token_ids),
            delta.SerializeToString(),
            self.unfinished_ttl_s,
            self.events_maxlen,
        ]
        if not await self._append_delta(keys=keys, args=args):
            raise Superseded(task_id)

    async def _set_for_run(self, task_id: str, run: str, field: str, value: str) -> None:
        if not await self._run_hset(keys=[self.keys.task(task_id)], args=[run, field, value]):
            raise Superseded(task_id)

    async def mark_admitted(self, task_id: str, run: str = "") -> None:
        """The task's turn was admitted against its key's request rate: no later attempt is."""
        await self._set_for_run(task_id, run, "admitted", "1")

    async def save_checkpoint(self, task_id: str, checkpoint: str, run: str = "") -> None:
        """Keep the running attempt's checkpoint (before its first token is appended)."""
        await self._set_for_run(task_id, run, "checkpoint", checkpoint)

    async def request_cancel(self, task_id: str) -> None:
        await self.redis.hset(self.keys.task(task_id), "cancel", "1")

    async def cancel_requested(self, task_id: str) -> bool:
        return bool(await self.redis.hget(self.keys.task(task_id), "cancel") == b"1")

    async def read_events(self, task_id: str, cursor: str, block_ms: int) -> list[tuple[str, bytes, bytes]]:
        """Events after ``cursor`` as (id, kind, payload); waits up to ``block_ms`` for the first."""
        found = await asyncio.shield(
            self.redis.xread({self.keys.events(task_id): cursor}, count=256, block=block_ms)
        )
        events: list[tuple[str, bytes, bytes]] = []
        for _, entries in found or ():
            for entry_id, fields in entries:
                events.append((entry_id.decode(), fields[EVENT_KIND], fields[EVENT_PAYLOAD]))
        return events

    async def exists(self, task_id: str) -> bool:
        return bool(await self.redis.exists(self.keys.task(task_id)))

    # --- the work queue -------------------------------------------------------------

    async def take_new(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, str]]:
        """Up to ``count`` never-delivered entries as (entry id, task id); blocks up to ``block_ms``."""
        found = await asyncio.shield(
            self.redis.xreadgroup(GROUP, consumer, {self.keys.stream: ">"}, count=count, block=block_ms)
        )
        return [
            (eid.decode(), fields[b"task_id"].decode())
            for _, entries in found or ()
            for eid, fields in entries
        ]

    async def reclaim(self, consumer: str, min_idle_ms: int, count: int) -> list[tuple[str, str]]:
        """Entries another (dead) router took but left unacknowledged longer than ``min_idle_ms``."""
        claimed: list[tuple[str, str]] = []
        start = "0-0"
        while len(claimed) < count:
            result = await self.redis.xautoclaim(
                self.keys.stream,
                GROUP,
                consumer,
                min_idle_time=min_idle_ms,
                start_id=start,
                count=count - len(claimed),
            )
            start, entries = result[0], result[1]
            for eid, fields in entries:
                if fields:  # an entry trimmed from the stream comes back empty
                    claimed.append((eid.decode(), fields[b"task_id"].decode()))
                else:
                    await self.ack(eid.decode())
            if start in (b"0-0", "0-0"):
                break
        return claimed

    async def heartbeat(self, consumer: str, running: list[tuple[str, str]]) -> list[str]:
        """Reset the idle time of the entries (entry id, task id) this router still owns, so nobody
        reclaims them, and keep their tasks' keys alive; returns the entry ids another router took
        over (their runs here must stop)."""
        if not running:
            return []
        keys = [self.keys.stream]
        for _, task_id in running:
            keys += [
                self.keys.task(task_id),
                self.keys.text(task_id),
                self.keys.tokens(task_id),
                self.keys.events(task_id),
            ]
        args: list[Any] = [GROUP, consumer, self.unfinished_ttl_s, *(entry_id for entry_id, _ in running)]
        lost = await self._heartbeat(keys=keys, args=args)
        return [e.decode() if isinstance(e, bytes) else str(e) for e in lost]

    async def hand_back(self, entry_id: str, record: TaskRecord) -> bool:
        """Queue a task this router's stopping run owns again, at once, its attempt not counted."""
        now = now_ms()
        queued = router_pb2.Task()
        queued.CopyFrom(record.to_proto())
        queued.state, queued.updated_at_ms = router_pb2.TASK_STATE_QUEUED, now  # type: ignore[assignment]
        args = [
            record.run,
            GROUP,
            entry_id,
            record.task_id,
            router_pb2.TASK_STATE_RUNNING,
            router_pb2.TASK_STATE_QUEUED,
            now,
            queued.SerializeToString(),
            self.events_maxlen,
        ]
        keys = [self.keys.task(record.task_id), self.keys.stream, self.keys.events(record.task_id)]
        return bool(await self._hand_back(keys=keys, args=args))

    async def ack(self, entry_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(self.keys.stream, GROUP, entry_id)
        pipe.xdel(self.keys.stream, entry_id)
        await pipe.execute()
