"""What the prefix cache stored and evicted, as numbered deltas for the router (``WatchKvEvents``).

The block manager records each hash it registers for prefix reuse (``stored``) and each one it
stops offering (``evicted``) as it goes; ``publish()``, once per engine step, seals them into
one ``KvDelta`` with the next sequence number (no delta for a step that changed nothing, so the
numbers have no holes). A hash stored and evicted within one step cancels out: a delta says how
the cached set changed from the previous sequence, and its two lists never share a hash.

The engine thread only appends to a bounded ring under a short lock; watchers (the asyncio
side) read from it at their own pace. One that falls more than ``capacity`` deltas behind gets
``None`` from ``since`` and starts again from ``snapshot()``: a slow watcher costs a snapshot,
never memory or engine time. Pure: no asyncio, no grpc, no torch.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: Deltas kept for watchers that lag (≈ 1,000 engine steps, seconds of traffic).
DEFAULT_CAPACITY = 1024


@dataclass(frozen=True)
class KvDelta:
    """How the cached set changed at one engine step."""

    sequence: int
    stored: tuple[int, ...]
    evicted: tuple[int, ...]
    #: Wall-clock seconds at ``publish`` (the router's event lag is measured from it).
    published_at: float = 0.0


@dataclass(frozen=True)
class KvSnapshot:
    """Every hash cached as of ``sequence``, in the process ``incarnation``."""

    incarnation: str
    sequence: int
    block_size: int
    block_hashes: tuple[int, ...]


class KvEventLog:
    """The numbered history of one block manager's prefix cache."""

    def __init__(self, block_size: int, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.block_size = block_size
        #: Unique to this process start: a router seeing another one knows the cache was lost.
        self.incarnation = uuid.uuid4().hex
        self._lock = threading.Lock()
        # The cached set as of ``_sequence``: what a snapshot copies (the block manager's own
        # map is the engine thread's, unlocked).
        self._cached: set[int] = set()
        self._sequence = 0
        self._deltas: deque[KvDelta] = deque(maxlen=capacity)
        self._listeners: list[Callable[[], None]] = []
        # Engine thread only: hash -> cached at the end of this step.
        self._pending: dict[int, bool] = {}

    # -- the engine thread -------------------------------------------------------
    def stored(self, block_hash: int) -> None:
        self._pending[block_hash] = True

    def evicted(self, block_hash: int) -> None:
        self._pending[block_hash] = False

    def publish(self) -> KvDelta | None:
        """Seal what changed since the last call into the next delta and wake the watchers."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, {}
        with self._lock:
            cached = self._cached
            stored = tuple(h for h, now in pending.items() if now and h not in cached)
            evicted = tuple(h for h, now in pending.items() if not now and h in cached)
            if not stored and not evicted:
                return None
            cached.difference_update(evicted)
            cached.update(stored)
            self._sequence += 1
            delta = KvDelta(self._sequence, stored, evicted, time.time())
            self._deltas.append(delta)
            listeners = list(self._listeners)
        for wake in listeners:
            wake()
        return delta

    # -- any thread ---------------------------------------------------------------
    @property
    def sequence(self) -> int:
        with self._lock:
            return self._sequence

    def snapshot(self) -> KvSnapshot:
        with self._lock:
            return KvSnapshot(self.incarnation, self._sequence, self.block_size, tuple(self._cached))

    def since(self, sequence: int) -> list[KvDelta] | None:
        """The deltas after ``sequence`` (empty when none yet); None when they are no longer
        all kept (the watcher fell behind) or ``sequence`` is not this log's."""
        with self._lock:
            if sequence > self._sequence:
                return None
            missing = self._sequence - sequence
            if missing > len(self._deltas):
                return None
            deltas = self._deltas
            return [deltas[i] for i in range(len(deltas) - missing, len(deltas))]

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake`` (from the engine thread, so it must not block) after each delta; returns
        the unsubscribe."""
        with self._lock:
            self._listeners.append(wake)

        def unsubscribe() -> None:
            with self._lock:
                if wake in self._listeners:
                    self._listeners.remove(wake)

        return unsubscribe
