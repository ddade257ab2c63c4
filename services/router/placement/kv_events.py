"""Feeds the prefix index from every replica's ``WatchKvEvents`` stream, one task per replica.

Each task subscribes, applies the snapshot and then each delta; a hole in the sequence numbers
(or a delta the index refuses: another incarnation) makes it subscribe again for a fresh
snapshot at once. A broken or ended stream forgets the replica's entry (a replica that comes
back may have restarted with an empty cache) and reconnects after an exponential, jittered
backoff. The backoff starts over only after a subscription that stayed up
(``Backoff.stable_s``): a draining replica answers each subscription with a snapshot and ends
it at once, and starting over on every snapshot resubscribed to it four times a second for its
whole drain. Repeated gaps back off the same way (the first resubscribes at once). Events that
claim more blocks than the replica can hold (``prefix_index.IndexOverflow``) drop its entry
(approximate mode), log a warning and count a resync (``overflow``), and back off as a broken
stream does. A replica that answers UNIMPLEMENTED (an older version) stays in the index's
approximate mode: one log line, then a quiet look every ``UNSUPPORTED_RETRY_S`` in case it
was upgraded. A replica that leaves the pool has its task cancelled and its entry forgotten.
Every router instance runs its own consumer against every replica, so all of them hold the
same index without sharing state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from services.gen.llmmesh.v1 import inference_pb2
from services.router import metrics
from services.router.placement.pool import Replica, ReplicaPool
from services.router.placement.prefix_index import IndexOverflow

log = logging.getLogger("llmmesh.router.kv_events")

#: How long an older replica without the RPC is left alone before it is asked again.
UNSUPPORTED_RETRY_S = 60.0


class PrefixIndexFeed(Protocol):
    """The part of the prefix index (``prefix_index.PrefixIndex``) that KV events write."""

    def apply_snapshot(
        self,
        replica: str,
        incarnation: str,
        sequence: int,
        block_size: int,
        block_hashes: Iterable[int],
        capacity: int = 0,
    ) -> None: ...

    def apply_delta(
        self,
        replica: str,
        incarnation: str,
        sequence: int,
        stored: Sequence[int],
        evicted: Sequence[int],
        capacity: int = 0,
    ) -> bool: ...

    def forget(self, replica: str) -> None: ...

    def block_count(self, replica: str) -> int: ...


@dataclass(frozen=True)
class Backoff:
    """Reconnect delays: ``first_s`` doubling up to ``max_s``, each with ±``jitter`` (0..1); back
    to ``first_s`` after a subscription that stayed up ``stable_s``."""

    first_s: float = 0.25
    max_s: float = 5.0
    jitter: float = 0.2
    #: A subscription that lasted this long was a success: the next failure starts afresh. A
    #: snapshot alone is no success: a draining replica sends one, then ends the stream. As long
    #: as the longest wait, so a replica that keeps ending streams is asked at most about once
    #: per ``max_s`` (a stable stream, a short wait, then the climb again).
    stable_s: float = 5.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        base = min(self.max_s, self.first_s * 2 ** max(0, attempt))
        return base * (1 + self.jitter * (2 * rng.random() - 1))


class Resync(Exception):
    """The stream's events no longer follow on from what was applied: subscribe again."""


class KvEventsConsumer:
    """One watcher task per replica in the pool, writing into ``index``."""

    def __init__(
        self,
        pool: ReplicaPool,
        index: PrefixIndexFeed,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.index = index
        self.backoff = backoff or Backoff()
        self._rng = rng or random.Random()
        self._wall = wall_clock
        #: How long a subscription lasted (``Backoff.stable_s``).
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._started = False

    def start(self) -> None:
        """Follow the pool from now on: replicas added or removed start or stop their watcher."""
        self._started = True
        self.pool.on_models_changed.append(self.sync)
        self.sync()

    def sync(self) -> None:
        if not self._started:
            return
        for address, replica in self.pool.replicas.items():
            if address not in self._tasks:
                task = asyncio.get_running_loop().create_task(
                    self._follow(replica), name=f"kv-events {address}"
                )
                self._tasks[address] = task
        for address in [a for a in self._tasks if a not in self.pool.replicas]:
            self._tasks.pop(address).cancel()  # its finally forgets the entry

    async def stop(self) -> None:
        self._started = False
        with contextlib.suppress(ValueError):
            self.pool.on_models_changed.remove(self.sync)
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, replica: Replica) -> None:
        address = replica.address
        #: Failed or short subscriptions since the last one that stayed up: the backoff's step.
        attempt = 0
        told_unsupported = told_overflow = told_invalid = False
        try:
            while True:
                began = self._clock()
                try:
                    await self._consume(replica)
                    reason = "ended"  # the replica drained, or a restart closed the stream cleanly
                except Resync:
                    reason = "gap"
                except ValueError as exc:
                    # A message the index cannot take (a snapshot with block size 0): it ended
                    # this replica's watcher task for good, silently. Now it is said, and the
                    # subscription is tried again at the backoff's pace, as for a broken stream.
                    reason = "invalid"
                    level = logging.DEBUG if told_invalid else logging.WARNING
                    log.log(level, "KV events from %s refused: %s (approximate mode)", address, exc)
                    told_invalid = True
                except IndexOverflow as exc:
                    reason = "overflow"
                    # Once at WARNING per watcher (the metric counts each): a replica that keeps
                    # doing it is retried at the backoff's pace, and each retry would say it again.
                    level = logging.DEBUG if told_overflow else logging.WARNING
                    log.log(level, "KV events: %s; its prefix index entry is dropped (approximate mode)", exc)
                    told_overflow = True
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                        if not told_unsupported:
                            log.info("%s has no WatchKvEvents: prefix placement stays approximate", address)
                            told_unsupported = True
                        # Not forgotten: its entry is the approximate one, what this router sent.
                        replica.kv_events_live = False
                        await asyncio.sleep(UNSUPPORTED_RETRY_S)
                        continue
                    reason = "broken"
                    log.debug("KV events from %s: %s", address, exc.code().name)
                metrics.KV_RESYNCS.labels(reason=reason).inc()
                if self._clock() - began >= self.backoff.stable_s:
                    attempt = 0  # it stayed up: this failure is the first of its kind
                if reason == "gap":
                    # The replica is up, only this watcher's view is off: a fresh snapshot at once
                    # (the index keeps the entry, stale, until it comes). Gaps that keep coming
                    # (a replica whose numbering is broken) back off like any failure.
                    if attempt:
                        await asyncio.sleep(self.backoff.delay(attempt, self._rng))
                    attempt += 1
                    continue
                self._lost(address, replica)
                await asyncio.sleep(self.backoff.delay(attempt, self._rng))
                attempt += 1
        finally:
            self._lost(address, replica)
            for gauge in (metrics.KV_INDEX_BLOCKS, metrics.KV_EVENT_LAG):
                with contextlib.suppress(KeyError):  # never set for this replica
                    gauge.remove(address)

    def _lost(self, address: str, replica: Replica) -> None:
        """Nothing is known of the replica's cache any more (until its next snapshot)."""
        replica.kv_events_live = False
        self.index.forget(address)
        metrics.KV_INDEX_BLOCKS.labels(replica=address).set(0)

    async def _consume(self, replica: Replica) -> None:
        """One subscription until it ends. Raises ``Resync`` or ``IndexOverflow``."""
        address = replica.address
        call = replica.stub.WatchKvEvents(inference_pb2.WatchKvEventsRequest())
        incarnation: str | None = None
        sequence = 0
        try:
            async for message in call:
                # The replica's KV blocks in all (its load report; 0 before the first): the
                # index holds no more of its blocks than that (prefix_index.precise_limit).
                capacity = replica.last_load.kv_blocks_total
                if message.HasField("snapshot"):
                    snap = message.snapshot
                    self.index.apply_snapshot(
                        address, snap.incarnation, snap.sequence, snap.block_size, snap.block_hashes, capacity
                    )
                    incarnation, sequence = snap.incarnation, snap.sequence
                    replica.kv_block_size = snap.block_size
                    replica.kv_events_live = True
                for delta in message.deltas:
                    if incarnation is None or delta.sequence != sequence + 1:
                        raise Resync
                    if not self.index.apply_delta(
                        address, incarnation, delta.sequence, delta.stored, delta.evicted, capacity
                    ):
                        raise Resync
                    sequence = delta.sequence
                self._observe(address, message.published_unix_ms)
        finally:
            call.cancel()

    def _observe(self, address: str, published_unix_ms: int) -> None:
        metrics.KV_INDEX_BLOCKS.labels(replica=address).set(self.index.block_count(address))
        if published_unix_ms:
            lag = max(0.0, self._wall() - published_unix_ms / 1000.0)
            metrics.KV_EVENT_LAG.labels(replica=address).set(lag)
