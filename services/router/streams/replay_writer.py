"""Copies every turn's messages into the replay buffer off the hot path, batched, in order.

A Redis round trip per message, or even per turn, costs the router more than
relaying the messages: redis-py's pipeline machinery is Python, per command.
So one flusher per buffer takes what every live turn queued since its last
flush and writes it in one round trip: one script call per turn (its entries,
plus the end marker after the TurnEnd; the same keys and entry ids as
``ReplayBuffer.append``). Under load the batches grow and Redis work per
token falls; an idle router flushes each message at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from typing import Any

import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from services.gen.llmmesh.v1 import router_pb2
from services.router.streams.replay import FINISHED_FIELD, PAYLOAD_FIELD, ReplayBuffer, meta_key, stream_key

log = logging.getLogger("llmmesh.router.replay")

# KEYS: stream, meta. ARGV: tenant, ttl, maxlen, finish (0/1), then seq, payload pairs.
# One turn's batch, atomic as the old MULTI was; a seq already stored is skipped (appends are idempotent).
APPEND_LUA = f"""
redis.call('HSETNX', KEYS[2], 'tenant', ARGV[1])
for i = 5, #ARGV, 2 do
  local added = redis.pcall('XADD', KEYS[1], 'MAXLEN', ARGV[3], ARGV[i] .. '-0', '{PAYLOAD_FIELD.decode()}', ARGV[i + 1])
  if type(added) == 'table' and added.err and not string.find(added.err, 'equal or smaller') then
    return added
  end
end
if ARGV[4] == '1' then
  redis.call('XADD', KEYS[1], 'MAXLEN', tonumber(ARGV[3]) + 1, '*', '{FINISHED_FIELD.decode()}', '1')
  redis.call('HSET', KEYS[2], 'finished', '1')
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""


class ReplayWriter:
    """One turn's writer: ``put`` each message (never blocks), ``end`` after the last, ``close`` to wait."""

    def __init__(self, buffer: ReplayBuffer, request_id: str, tenant: str) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self._flusher = ReplayFlusher.of(buffer)
        self._pending: list[tuple[int, bytes]] = []
        self._failed = False
        self._ended = False
        self._end_queued = False
        self._written = asyncio.Event()  # set once the end marker is stored, or the writer gave up

    def put(self, response: router_pb2.ChatResponse) -> None:
        if not self._failed and not self._ended:
            self._pending.append((response.seq, response.SerializeToString()))
            self._flusher.want(self)

    def end(self) -> None:
        """No message follows: the buffer is marked finished after the last one (idempotent)."""
        if not self._ended:
            self._ended = True
            if self._failed:
                self._written.set()
            else:
                self._flusher.want(self)

    async def close(self) -> None:
        self.end()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._written.wait(), timeout=5.0)

    def take_batch(self) -> tuple[list[tuple[int, bytes]], bool]:
        """What the next flush writes for this turn: its queued entries, and whether to end it."""
        entries, self._pending = self._pending, []
        finish = self._ended and not self._end_queued
        self._end_queued = self._end_queued or finish
        return entries, finish

    def flushed(self, finished: bool) -> None:
        if finished:
            self._written.set()

    def give_up(self, exc: BaseException) -> None:
        # Resume is best effort: a Redis outage must not fail the answer.
        if not self._failed:
            log.warning("replay buffer for %s stopped: %s", self.request_id, exc)
        self._failed = True
        self._pending.clear()
        self._written.set()


class ReplayFlusher:
    """Writes every waiting turn's batch to Redis in one round trip, one flush at a time, in order."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.buffer = buffer
        self._waiting: dict[int, ReplayWriter] = {}  # insertion-ordered, each writer once
        self._task: asyncio.Task[None] | None = None
        self._sha: str | None = None

    @classmethod
    def of(cls, buffer: ReplayBuffer) -> ReplayFlusher:
        flusher = _FLUSHERS.get(buffer)
        if flusher is None:
            flusher = _FLUSHERS[buffer] = cls(buffer)
        return flusher

    def want(self, writer: ReplayWriter) -> None:
        """``writer`` has something to write: it goes in the next flush."""
        self._waiting[id(writer)] = writer
        # The task ends when nothing waits; with no await between its last look and its end,
        # a writer added after that look always finds it done and starts a new one.
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._waiting:
            writers = list(self._waiting.values())
            self._waiting.clear()
            batches = [(w, *w.take_batch()) for w in writers]
            batches = [b for b in batches if b[1] or b[2]]
            if not batches:
                continue
            try:
                results = await self._write(batches)
            except Exception as exc:  # the whole round trip failed: every turn in it stops
                for writer, _, _ in batches:
                    writer.give_up(exc)
                continue
            for (writer, _, finish), result in zip(batches, results, strict=True):
                if isinstance(result, Exception):
                    writer.give_up(result)
                else:
                    writer.flushed(finish)

    async def _write(self, batches: list[tuple[ReplayWriter, list[tuple[int, bytes]], bool]]) -> list[Any]:
        """One result per batch: the script's reply, or the exception Redis answered for that turn."""
        redis_client = self.buffer.redis
        if self._sha is None:
            self._sha = await redis_client.script_load(APPEND_LUA)
        results = await self._append_all(batches)
        missing = [i for i, r in enumerate(results) if isinstance(r, redis.exceptions.NoScriptError)]
        if missing:
            # Redis restarted and forgot the script: load it again and redo those turns only.
            self._sha = await redis_client.script_load(APPEND_LUA)
            for i, result in zip(missing, await self._append_all([batches[i] for i in missing]), strict=True):
                results[i] = result
        return results

    async def _append_all(
        self, batches: list[tuple[ReplayWriter, list[tuple[int, bytes]], bool]]
    ) -> list[Any]:
        calls: list[tuple[Any, ...]] = []
        for writer, entries, finish in batches:
            args: list[Any] = [writer.tenant, self.buffer.ttl_s, self.buffer.max_messages, int(finish)]
            for seq, payload in entries:
                args += [seq, payload]
            keys = (stream_key(writer.request_id, writer.tenant), meta_key(writer.request_id, writer.tenant))
            calls.append((self._sha, 2, *keys, *args))
        client = self.buffer.redis
        if isinstance(client, RedisCluster):
            # redis-py refuses scripts in cluster pipelines: one call per turn, all at once
            # (each goes to its turn's slot; the client keeps a connection per node busy).
            return list(await asyncio.gather(*(client.evalsha(*c) for c in calls), return_exceptions=True))
        pipe = client.pipeline(transaction=False)
        for call in calls:
            pipe.evalsha(*call)
        return list(await pipe.execute(raise_on_error=False))


#: One flusher per buffer (so per Redis client), made on first use.
_FLUSHERS: weakref.WeakKeyDictionary[ReplayBuffer, ReplayFlusher] = weakref.WeakKeyDictionary()
