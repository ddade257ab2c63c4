"""Replay buffer: every message of a generation kept briefly in Redis, so any router can serve ``Resume``.

One Redis Stream per tenant and request id, ``llm:replay:{tenant:id}``, whose entry ids are
``<seq>-0``: appending the same seq twice is refused by Redis itself, which
makes appends idempotent, and ``XRANGE (<last_seq>-0 +`` is the replay. A
sentinel entry marks the end. A hash ``llm:replay:{tenant:id}:meta`` records the
owning tenant. A client's request id is its own: another tenant's turn with the same id
has other keys, so it can neither read this one nor take its seqs (before 2026-12-07 the
keys held the id alone, and the first tenant to write an id owned it). Both expire ``ttl_s`` after the last write; the stream is capped
at ``max_messages`` (a reader that fell further behind is told so).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import redis.exceptions

from services.common import errors

FINISHED_FIELD = b"end"
PAYLOAD_FIELD = b"p"


#: Entry ids below this are seqs, above it the end marker's milliseconds (``_seq_of``): a
#: ``last_seq`` past it would read after the end marker and wait for a message that never comes.
MAX_SEQ = 10**11 - 1


def stream_key(request_id: str, tenant: str) -> str:
    return f"llm:replay:{{{tenant}:{request_id}}}"


def meta_key(request_id: str, tenant: str) -> str:
    # Same hash tag as the stream: one Cluster slot, so the pair can be written in one transaction.
    return f"llm:replay:{{{tenant}:{request_id}}}:meta"


class ReplayBuffer:
    """Append-only per-request message log with a bounded length and a TTL."""

    def __init__(
        self,
        redis: Any,
        max_messages: int = 4096,
        ttl_s: int = 600,
        poll_block_ms: int = 1000,
        stall_timeout_s: float = 120.0,
    ) -> None:
        if max_messages < 1:
            raise ValueError(f"max_messages: must be >= 1, got {max_messages}")
        if ttl_s < 1:
            raise ValueError(f"ttl_s: must be >= 1, got {ttl_s}")
        self.redis = redis
        self.max_messages = max_messages
        self.ttl_s = ttl_s
        self.poll_block_ms = poll_block_ms
        # A writer that died without finish(): readers give up after this long without news.
        self.stall_timeout_s = stall_timeout_s

    async def append(self, request_id: str, tenant: str, seq: int, payload: bytes) -> bool:
        """Record message ``seq`` (1, 2, …); False when that seq is already stored (a retried append)."""
        if seq < 1:
            raise ValueError(f"seq: must be >= 1, got {seq}")
        pipe = self.redis.pipeline(transaction=True)
        pipe.hsetnx(meta_key(request_id, tenant), "tenant", tenant)
        pipe.xadd(
            stream_key(request_id, tenant),
            {PAYLOAD_FIELD: payload},
            id=f"{seq}-0",
            maxlen=self.max_messages,
            approximate=False,
        )
        pipe.expire(meta_key(request_id, tenant), self.ttl_s)
        pipe.expire(stream_key(request_id, tenant), self.ttl_s)
        results = await pipe.execute(raise_on_error=False)
        if isinstance(results[1], redis.exceptions.ResponseError):
            if "equal or smaller" in str(results[1]):
                return False
            raise results[1]
        return True

    async def finish(self, request_id: str, tenant: str) -> None:
        """Mark the generation over: readers stop after the last message."""
        pipe = self.redis.pipeline(transaction=True)
        # An auto id (milliseconds since 1970) sorts after every seq-based id.
        pipe.xadd(
            stream_key(request_id, tenant),
            {FINISHED_FIELD: b"1"},
            maxlen=self.max_messages + 1,
            approximate=False,
        )
        pipe.hset(meta_key(request_id, tenant), "finished", "1")
        pipe.expire(meta_key(request_id, tenant), self.ttl_s)
        pipe.expire(stream_key(request_id, tenant), self.ttl_s)
        await pipe.execute()

    async def holds(self, request_id: str, tenant: str) -> bool:
        """Whether a turn of ``tenant`` by this id is buffered."""
        return bool(await self.redis.exists(meta_key(request_id, tenant)))

    async def read_after(self, request_id: str, tenant: str, last_seq: int) -> AsyncIterator[bytes]:
        """Messages after ``last_seq``, each once, then live ones until the generation finishes."""
        if not 0 <= last_seq <= MAX_SEQ:
            raise errors.InvalidArgument("last_seq", f"must be in 0..{MAX_SEQ}, got {last_seq}")
        if not await self.holds(request_id, tenant):
            # Another tenant's turn by this id is not this tenant's to know of: not found either.
            raise errors.NotFound(f"request_id: no buffered generation {request_id!r} (unknown or expired)")
        key = stream_key(request_id, tenant)
        first = await self.redis.xrange(key, count=1)
        if first and _seq_of(first[0][0]) is not None:
            oldest = _seq_of(first[0][0])
            assert oldest is not None
            if oldest > last_seq + 1:
                raise errors.FailedPrecondition(
                    f"last_seq: messages {last_seq + 1}..{oldest - 1} of {request_id!r} are no longer buffered"
                    f" (the buffer keeps {self.max_messages})"
                )
        cursor = f"{last_seq}-0"
        idle_since = asyncio.get_running_loop().time()
        while True:
            # Exclusive start: everything strictly after the cursor, in order.
            entries = await self.redis.xrange(key, min=f"({cursor}", count=256)
            if not entries:
                if not await self.holds(request_id, tenant):
                    raise errors.NotFound(f"request_id: buffered generation {request_id!r} expired")
                if asyncio.get_running_loop().time() - idle_since > self.stall_timeout_s:
                    raise errors.DependencyUnavailable(
                        f"generation {request_id!r} stalled: no message for {self.stall_timeout_s:.0f}s"
                    )
                # Wait for the next entry instead of polling in a tight loop.
                # Shielded: see tasks.py on cancelling a blocking read (the client may go away here).
                await asyncio.shield(self.redis.xread({key: cursor}, count=1, block=self.poll_block_ms))
                continue
            idle_since = asyncio.get_running_loop().time()
            for entry_id, fields in entries:
                if FINISHED_FIELD in fields:
                    return
                cursor = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                yield fields[PAYLOAD_FIELD]


def _seq_of(entry_id: bytes | str) -> int | None:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, part = text.partition("-")
    # Seq entries are "<seq>-0" with seq far below any real millisecond clock.
    return int(ms) if part == "0" and int(ms) <= MAX_SEQ else None
