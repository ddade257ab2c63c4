"""Moves a lost replica's sessions to their ring successors and pre-warms the new replica's prefix cache.

When a replica is ejected or stops serving, each session this router recently
sent there is re-pinned to the replica its next turn would pick (the ring
successor under affinity), and that replica is sent the session's history as
a one-token generation, so the next turn finds its prefix already cached.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import grpc

from services.common import errors
from services.common.generate_many.client import StreamBroken
from services.gen.llmmesh.v1 import common_pb2, inference_pb2
from services.router.placement.pins import AffinityPins
from services.router.placement.pool import Replica, ReplicaPool, generate_to_end


class PickReplica(Protocol):
    """The choice the next turn would make (``ReplicaPicker.pick``): a replica and its model, or None."""

    def __call__(
        self, models: Sequence[str], session_key: str | None, exclude: set[str], deadline: float | None
    ) -> tuple[Replica, str] | None: ...


#: A session's history as chat messages (role, content) to pre-warm with; the turns layer
#: provides it (turns/warm_history.py), so placement never reaches up into the conversation.
LoadMessages = Callable[[str, str], Awaitable[list[dict[str, str]]]]

log = logging.getLogger("llmmesh.router.prewarm")

#: A pre-warm reads a whole history as one prompt: it may queue behind a busy replica's work.
PREWARM_TIMEOUT_S = 30.0


class SessionMover:
    """Remembers which sessions each replica holds warm; moves them when the replica goes."""

    def __init__(
        self,
        pool: ReplicaPool,
        pick: PickReplica,
        pins: AffinityPins,
        load_messages: LoadMessages | None,
        sessions_per_replica: int = 256,
    ) -> None:
        self.pool = pool
        self.pick = pick
        self.pins = pins
        #: None when the router has no session service: nothing to pre-warm with.
        self.load_messages = load_messages
        self.sessions_per_replica = sessions_per_replica
        #: Per replica, its recent sessions (tenant, session id) and their generations' cache salt.
        self._recent: dict[str, OrderedDict[tuple[str, str], str]] = {}
        self._tasks: set[asyncio.Task[int]] = set()
        pool.on_unavailable.append(self.replica_lost)

    def note(self, replica: str, tenant: str, session_id: str, cache_salt: str = "") -> None:
        """A turn of this session just ran on ``replica``, its prompt blocks salted with ``cache_salt``
        (the pre-warm must salt them alike, or the next turn would find none of them)."""
        recent = self._recent.setdefault(replica, OrderedDict())
        recent[(tenant, session_id)] = cache_salt
        recent.move_to_end((tenant, session_id))
        while len(recent) > self.sessions_per_replica:
            recent.popitem(last=False)

    def replica_lost(self, replica: Replica) -> None:
        sessions = self._recent.pop(replica.address, None)
        if not sessions or replica.model is None:
            return
        task = asyncio.get_running_loop().create_task(
            self.move(replica.address, replica.model, list(sessions.items()))
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def move(self, lost: str, model: str, sessions: list[tuple[tuple[str, str], str]]) -> int:
        """Re-pin and pre-warm ``sessions`` ((tenant, session id), cache salt); returns how many were
        pre-warmed."""
        warmed = 0
        for (tenant, session_id), cache_salt in sessions:
            if await self.pins.get(tenant, session_id) not in (lost, None):
                continue  # another router or a later turn already moved it
            picked = self.pick([model], f"{tenant}:{session_id}", {lost}, None)
            if picked is None:
                return warmed
            target = picked[0]
            await self.pins.set(tenant, session_id, target.address)
            self.note(target.address, tenant, session_id, cache_salt)
            if await self.prewarm(target, tenant, session_id, cache_salt):
                warmed += 1
        log.info("moved %d sessions off %s (%d pre-warmed)", len(sessions), lost, warmed)
        return warmed

    async def prewarm(self, target: Replica, tenant: str, session_id: str, cache_salt: str = "") -> bool:
        if self.load_messages is None:
            return False
        try:
            messages = await self.load_messages(tenant, session_id)
        except (errors.MeshError, grpc.aio.AioRpcError) as exc:
            log.debug("no history to pre-warm %s: %s", session_id, exc)
            return False
        if not messages:
            return False
        start = inference_pb2.GenerateStart(
            request_id=f"prewarm-{uuid.uuid4().hex}",  # unique, as the probes' (health.py)
            messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0),
            cache_salt=cache_salt,
        )
        # On the shared GenerateMany stream, as the session's next turn will be.
        try:
            end = await generate_to_end(target, start, PREWARM_TIMEOUT_S)
        except (StreamBroken, TimeoutError) as exc:
            log.debug("pre-warm of %s on %s failed: %r", session_id, target.address, exc)
            return False
        if end.WhichOneof("event") == "error":
            log.debug("pre-warm of %s on %s failed: %s", session_id, target.address, end.error.message)
            return False
        return True

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
