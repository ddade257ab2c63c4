"""Copies a turn's messages into the replay buffer off the hot path, batched, in order.

One Redis transaction per message would cost the router more than relaying the
message itself; the writer instead takes everything queued since its last
write and appends it in one transaction (the same keys and entry ids as
``ReplayBuffer.append``), so under load batches grow and Redis work per token falls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.exceptions

from services.gen.llmmesh.v1 import router_pb2
from services.router.replay import PAYLOAD_FIELD, ReplayBuffer, meta_key, stream_key

log = logging.getLogger("llmmesh.router.replay")


class ReplayWriter:
    """One turn's writer: ``put`` each message (never blocks), ``close`` when the turn ends."""

    def __init__(self, buffer: ReplayBuffer, request_id: str, tenant: str) -> None:
        self.buffer = buffer
        self.request_id = request_id
        self.tenant = tenant
        self._queue: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue()
        self._failed = False
        self._task = asyncio.create_task(self._run())

    def put(self, response: router_pb2.ChatResponse) -> None:
        if not self._failed:
            self._queue.put_nowait((response.seq, response.SerializeToString()))

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            entries = [item for item in batch if item is not None]
            try:
                if entries:
                    await self._append(entries)
                if batch[-1] is None:
                    await self.buffer.finish(self.request_id)
                    return
            except Exception as exc:  # Resume is best effort: a Redis outage must not fail the answer
                log.warning("replay buffer for %s stopped: %s", self.request_id, exc)
                self._failed = True
                return

    async def _append(self, entries: list[tuple[int, bytes]]) -> None:
        meta, stream = meta_key(self.request_id), stream_key(self.request_id)
        pipe = self.buffer.redis.pipeline(transaction=True)
        pipe.hsetnx(meta, "tenant", self.tenant)
        for seq, payload in entries:
            pipe.xadd(
                stream,
                {PAYLOAD_FIELD: payload},
                id=f"{seq}-0",
                maxlen=self.buffer.max_messages,
                approximate=False,
            )
        pipe.expire(meta, self.buffer.ttl_s)
        pipe.expire(stream, self.buffer.ttl_s)
        for result in await pipe.execute(raise_on_error=False):
            # "equal or smaller" is a seq already stored: appends are idempotent.
            if isinstance(result, redis.exceptions.ResponseError) and "equal or smaller" not in str(result):
                raise result

    async def close(self) -> None:
        self._queue.put_nowait(None)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._task), timeout=5.0)
