"""Which prompt-prefix blocks each replica holds in its KV cache, for prefix-aware placement (pure).

Two sources per replica. *Precise*: the replica's own KV events — a snapshot of its cached
block hashes, then deltas (stored, evicted) numbered by a sequence that must run without a
gap within one incarnation of the replica; anything else marks the entry stale (unused until
the next snapshot) and tells the caller to resync. *Approximate*: what this router itself
sent where, each block remembered for ``approximate_ttl_s``; used for a replica with no fresh
precise entry (an older replica without events, a stream that is down).

*Pending*, beside a fresh precise entry: blocks this router sent there that the replica has
not reported stored yet. A prompt waits in the replica's queue and prefills for seconds on a
CPU before its first event; without this, every request of a burst behind one new prefix
would see no replica holding it and each would prefill it cold on another replica (SGLang's
router inserts into its tree when it routes, for the same reason). A pending block counts as
held until the replica's event stores it (from then on the events rule, evictions included)
or ``approximate_ttl_s`` passes (the request failed, or its blocks were never kept).

A block hash is an unsigned 64-bit int; hash *i* of a chain covers tokens
``[0, (i + 1) * block_size)``, so the longest cached prefix is found by walking the chain
until the first miss. Sets and dicts of ints: a lookup is one hash probe, which keeps
scoring 8 replicas against a 125-block prompt well under the 0.2 ms budget
(bench/placement_scoring.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

#: Approximate blocks kept per replica at most: beyond it the oldest go first, expired or not.
MAX_APPROXIMATE_BLOCKS = 200_000


@dataclass
class ApproximateEntry:
    """Blocks this router sent to one replica: each hash's expiry, in the order they expire.

    Every send has the same time to live, so the last sent is the last to expire: a send moves
    its hashes to the end, and expiry drops them from the front. One entry per hash, whatever the
    rate: a log of the sends (kept before 2026-12-07) held every send's hashes for the TTL, 128
    MiB for one hot 125-block prefix sent 200 times a second.
    """

    block_size: int
    expires: OrderedDict[int, float] = field(default_factory=OrderedDict)


@dataclass
class PreciseEntry:
    """One replica's blocks as its KV events describe them."""

    incarnation: str
    #: The last sequence number applied (the snapshot's, then each delta's).
    sequence: int
    block_size: int
    blocks: set[int]
    #: A gap, a reordering or a new incarnation was seen: wait for a snapshot.
    stale: bool = False
    #: Blocks this router sent that no event has stored yet (see the module's "Pending").
    pending: ApproximateEntry | None = None


def _walk(blocks: set[int], chain: Sequence[int]) -> int:
    """Leading hashes of ``chain`` found in ``blocks``."""
    n = 0
    for h in chain:
        if h not in blocks:
            break
        n += 1
    return n


def _walk_live(table: dict[int, float], chain: Sequence[int], now: float, start: int = 0) -> int:
    """Leading hashes of ``chain`` from ``start`` on whose expiry in ``table`` is after ``now``."""
    n = start
    for h in chain[start:]:
        expires = table.get(h)
        if expires is None or expires <= now:
            break
        n += 1
    return n


class PrefixIndex:
    """Per replica, the prefix blocks it holds (precise when fresh, else approximate)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, approximate_ttl_s: float = 120.0) -> None:
        if approximate_ttl_s <= 0:
            raise ValueError("approximate_ttl_s must be > 0")
        self._clock = clock
        self.approximate_ttl_s = approximate_ttl_s
        self._precise: dict[str, PreciseEntry] = {}
        self._approximate: dict[str, ApproximateEntry] = {}

    # Precise mode: the replica's KV events.

    def apply_snapshot(
        self, replica: str, incarnation: str, sequence: int, block_size: int, block_hashes: Iterable[int]
    ) -> None:
        """Replace the replica's entry with a full snapshot taken at ``sequence`` (precise mode)."""
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self._precise[replica] = PreciseEntry(incarnation, sequence, block_size, set(block_hashes))

    def apply_delta(
        self, replica: str, incarnation: str, sequence: int, stored: Sequence[int], evicted: Sequence[int]
    ) -> bool:
        """Apply one event. False (and the entry is marked stale, unused for scoring until the next
        snapshot) when ``sequence`` is not the next expected one or ``incarnation`` differs (the
        replica restarted): the caller resyncs."""
        entry = self._precise.get(replica)
        if entry is None or entry.stale:
            return False  # nothing to apply it to until a snapshot arrives
        if incarnation != entry.incarnation or sequence != entry.sequence + 1:
            entry.stale = True
            # A restarted replica's cache is empty: what it held before is no evidence now.
            if incarnation != entry.incarnation:
                entry.blocks.clear()
            return False
        entry.sequence = sequence
        # Evicted first: a block evicted and stored again in one event is held.
        entry.blocks.difference_update(evicted)
        entry.blocks.update(stored)
        if entry.pending is not None:
            # Stored: the events say from now on whether it is held (a later eviction included).
            table = entry.pending.expires
            for h in stored:
                table.pop(h, None)
        return True

    def forget(self, replica: str) -> None:
        """The replica is gone, restarted or its stream broke: nothing is known of its cache."""
        self._precise.pop(replica, None)
        self._approximate.pop(replica, None)

    def is_precise(self, replica: str) -> bool:
        """Whether lookups for ``replica`` use its events (a fresh precise entry)."""
        entry = self._precise.get(replica)
        return entry is not None and not entry.stale

    def sequence(self, replica: str) -> int | None:
        """The last event sequence applied for ``replica`` (None without a precise entry)."""
        entry = self._precise.get(replica)
        return None if entry is None else entry.sequence

    # Approximate mode: what this router sent.

    def record_sent(self, replica: str, block_size: int, block_hashes: Sequence[int]) -> None:
        """This router sent a prompt with these blocks there; each counts as held for
        approximate_ttl_s. With a fresh precise entry they are its pending blocks (held until an
        event stores them); otherwise the approximate entry (older replicas, stream down)."""
        if not block_hashes or block_size <= 0:
            return
        precise = self._precise.get(replica)
        if precise is not None and not precise.stale:
            if block_size != precise.block_size:
                return  # hashes over other token spans than the replica's blocks: never matched
            held = precise.blocks
            unseen = [h for h in block_hashes if h not in held]
            if unseen:
                if precise.pending is None:
                    precise.pending = ApproximateEntry(block_size)
                self._remember(precise.pending, unseen)
            return
        entry = self._approximate.get(replica)
        if entry is None or entry.block_size != block_size:
            entry = self._approximate[replica] = ApproximateEntry(block_size)
        self._remember(entry, block_hashes)

    def withdraw_sent(self, replica: str, block_size: int, block_hashes: Sequence[int]) -> None:
        """A request ``record_sent`` noted ended there before its prefill (refused as too long or
        busy, failed, cancelled while queued): its blocks that were only on their way are not.
        Noted for the TTL, a refused 40,000-token prompt made its replica look 40,000 prefill
        tokens busy for 120 s, and got it no work meanwhile. Another request of the same prefix
        sent there meanwhile loses them too: one cold prefill, not two minutes of none."""
        if not block_hashes or block_size <= 0:
            return
        precise = self._precise.get(replica)
        if precise is not None and not precise.stale:
            if precise.pending is not None and block_size == precise.block_size:
                table = precise.pending.expires
                for h in block_hashes:
                    table.pop(h, None)
            return
        entry = self._approximate.get(replica)
        if entry is not None and entry.block_size == block_size:
            for h in block_hashes:
                entry.expires.pop(h, None)

    def _remember(self, entry: ApproximateEntry, block_hashes: Sequence[int]) -> None:
        now = self._clock()
        expires = now + self.approximate_ttl_s
        table = entry.expires
        move = table.move_to_end
        for h in block_hashes:
            table[h] = expires
            move(h)
        self._expire(entry, now)

    @staticmethod
    def _expire(entry: ApproximateEntry, now: float) -> None:
        """Drop the hashes that expired (the front), and the oldest beyond the size limit."""
        table = entry.expires
        while table and (next(iter(table.values())) <= now or len(table) > MAX_APPROXIMATE_BLOCKS):
            table.popitem(last=False)

    # Lookups.

    def cached_prefix_blocks(self, replica: str, block_hashes: Sequence[int], block_size: int = 0) -> int:
        """How many leading blocks of the chain the replica holds (precise entry if fresh, else
        approximate). With ``block_size`` given, an entry kept at another block size counts none:
        its hashes cover other token spans."""
        entry = self._precise.get(replica)
        if entry is not None and not entry.stale:
            if block_size and block_size != entry.block_size:
                return 0
            blocks, pending = entry.blocks, entry.pending
            if pending is None or not pending.expires:
                return _walk(blocks, block_hashes)
            # Held or on its way: a pending block, then held ones after it, all count.
            table, now, n = pending.expires, self._clock(), 0
            while n < len(block_hashes):
                held = _walk(blocks, block_hashes[n:])
                n += held
                sent = _walk_live(table, block_hashes, now, n) - n
                n += sent
                if not held and not sent:
                    break
            return n
        approx = self._approximate.get(replica)
        if approx is None or (block_size and block_size != approx.block_size):
            return 0
        return _walk_live(approx.expires, block_hashes, self._clock())

    def pending_tokens_outside(self, replica: str, block_hashes: Sequence[int]) -> int:
        """Prompt tokens this router sent to ``replica`` that it has not stored yet (prefill queued
        or under way there), less those in ``block_hashes``: the cold prefills another request
        would wait behind. Blocks of its own chain are work it needs done anyway (it counts them as
        held), so a burst behind one new prefix still queues where the prefix is on its way, while
        another prefix's request sees seconds of prefill ahead of it there. 0 without a fresh
        precise entry: the approximate mode cannot tell a queued prefill from a finished one."""
        entry = self._precise.get(replica)
        if entry is None or entry.stale or entry.pending is None:
            return 0
        pending = entry.pending
        # Expired sends dropped, every hash left is live: counting is a size and one C-speed
        # intersection (a probe per block of the chain), not a walk with expiry checks.
        self._expire(pending, self._clock())
        table = pending.expires
        if not table:
            return 0
        return (len(table) - len(table.keys() & block_hashes)) * entry.block_size

    def block_count(self, replica: str) -> int:
        """Blocks indexed for ``replica``: its precise entry's if fresh, else its live approximate ones."""
        entry = self._precise.get(replica)
        if entry is not None and not entry.stale:
            return len(entry.blocks)
        approx = self._approximate.get(replica)
        if approx is None:
            return 0
        self._expire(approx, self._clock())
        return len(approx.expires)

    def replicas(self) -> list[str]:
        """Every replica with an entry of either kind."""
        return sorted(self._precise.keys() | self._approximate.keys())
