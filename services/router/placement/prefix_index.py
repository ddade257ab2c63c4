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
or ``approximate_ttl_s`` passes (the request failed, or its blocks were never kept). A pending
block counts as queued prefill too (``pending_tokens_outside``) until its request is prefilled
(``prefilled``): from then on, if no event stored it, it is *unreported* — held for what is
left of its TTL, but no work on its way. A snapshot keeps the pending and unreported blocks it
does not hold (see ``apply_snapshot``).

*Bounded*: a replica's precise blocks are at most what it can hold (its ``capacity``, the KV
blocks its load report gives, capped at ``MAX_PRECISE_BLOCKS``; that constant when unknown).
An entry past it is dropped and ``IndexOverflow`` raised (see ``apply_snapshot``).

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

#: Precise blocks kept per replica at most, whatever capacity it states (and the bound where it
#: states none). 2**20 blocks are 16 M tokens at the usual 16 a block: more KV cache than any
#: one accelerator holds for any real model (SmolLM2-135M's 23 KB a token would need 368 GB),
#: and ~68 MiB of router memory at most per replica (a Python set of 64-bit ints). Unbounded,
#: a replica (buggy or hostile) that reported millions of stored blocks grew the router without
#: limit: each delta message is bounded (gRPC's 4 MiB), their sum was not.
MAX_PRECISE_BLOCKS = 1 << 20


class IndexOverflow(Exception):
    """A replica's KV events claim more cached blocks than it can hold: the events are wrong
    (lost evictions, a bug, a hostile replica). The index dropped its precise entry."""

    def __init__(self, replica: str, blocks: int, limit: int) -> None:
        super().__init__(f"{replica} reports {blocks} cached KV blocks, over the {limit} it can hold")
        self.replica = replica
        self.blocks = blocks
        self.limit = limit


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
    #: Pending blocks whose request was prefilled without an event storing them (another
    #: tokenizer's hashes, or an event still on its way): held for their TTL, not queued work.
    unreported: ApproximateEntry | None = None


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


def _walk_sent(tables: Sequence[dict[int, float]], chain: Sequence[int], now: float, start: int = 0) -> int:
    """Leading hashes of ``chain`` from ``start`` on that are live in any of ``tables``."""
    if len(tables) == 1:
        return _walk_live(tables[0], chain, now, start)
    n = start
    for h in chain[start:]:
        if not any(t.get(h, now) > now for t in tables):
            break
        n += 1
    return n


class PrefixIndex:
    """Per replica, the prefix blocks it holds (precise when fresh, else approximate)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        approximate_ttl_s: float = 120.0,
        max_precise_blocks: int = MAX_PRECISE_BLOCKS,
    ) -> None:
        if approximate_ttl_s <= 0:
            raise ValueError("approximate_ttl_s must be > 0")
        if max_precise_blocks < 1:
            raise ValueError("max_precise_blocks must be >= 1")
        self._clock = clock
        self.approximate_ttl_s = approximate_ttl_s
        self.max_precise_blocks = max_precise_blocks
        self._precise: dict[str, PreciseEntry] = {}
        #: Per replica, one entry per block size sent there (see ``record_sent``).
        self._approximate: dict[str, dict[int, ApproximateEntry]] = {}

    # Precise mode: the replica's KV events.

    def precise_limit(self, capacity: int = 0) -> int:
        """Precise blocks indexed at most for a replica that holds ``capacity`` KV blocks in all
        (0: not known). A replica holds a block hash in at most one block, so its cached set is
        never larger than its cache: more is proof the events are wrong."""
        return min(capacity, self.max_precise_blocks) if capacity > 0 else self.max_precise_blocks

    def apply_snapshot(
        self,
        replica: str,
        incarnation: str,
        sequence: int,
        block_size: int,
        block_hashes: Iterable[int],
        capacity: int = 0,
    ) -> None:
        """Replace the replica's entry with a full snapshot taken at ``sequence`` (precise mode).

        Raises ``IndexOverflow`` (the entry dropped) when the snapshot holds more blocks than
        ``precise_limit(capacity)``: past what the replica can hold, the snapshot is wrong about
        some blocks and nothing says which, so none of it may be claimed (a block claimed in a
        chain that the replica does not hold sends a prompt where it prefills cold). Dropped,
        the replica is placed by what this router sends it (the approximate mode) until a
        snapshot fits.
        """
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        blocks = set(block_hashes)
        previous = self._precise.pop(replica, None)
        limit = self.precise_limit(capacity)
        if len(blocks) > limit:
            raise IndexOverflow(replica, len(blocks), limit)
        entry = self._precise[replica] = PreciseEntry(incarnation, sequence, block_size, blocks)
        if previous is not None and (previous.incarnation, previous.block_size) == (incarnation, block_size):
            # The same process: what this router sent there that no event stored is still on its
            # way (queued, prefilling) or was prefilled under hashes no event names. A snapshot
            # says only what is cached now, which tells no more about those than the missing
            # store events did. Dropped (until 2026-12-07), a just-routed prefix lost its pending
            # blocks each time the watcher fell behind and got a snapshot instead of the deltas
            # it missed, and the burst behind it prefilled cold elsewhere. Those the snapshot
            # holds are stored: the events rule them from now on. A restarted replica (another
            # incarnation) lost its queue with its cache: nothing is kept.
            now = self._clock()
            entry.pending = _carried(previous.pending, blocks, now)
            entry.unreported = _carried(previous.unreported, blocks, now)

    def apply_delta(
        self,
        replica: str,
        incarnation: str,
        sequence: int,
        stored: Sequence[int],
        evicted: Sequence[int],
        capacity: int = 0,
    ) -> bool:
        """Apply one event. False (and the entry is marked stale, unused for scoring until the next
        snapshot) when ``sequence`` is not the next expected one or ``incarnation`` differs (the
        replica restarted): the caller resyncs. Raises ``IndexOverflow`` (the entry dropped, as
        in ``apply_snapshot``) when the blocks held would exceed ``precise_limit(capacity)``."""
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
        blocks = entry.blocks
        # Evicted first: a block evicted and stored again in one event is held.
        blocks.difference_update(evicted)
        blocks.update(stored)
        limit = self.precise_limit(capacity)
        if len(blocks) > limit:
            # More than the replica holds: some block here is one it evicted (a lost eviction, a
            # bug, a hostile replica), and nothing says which. Trimming the oldest stored would
            # guess (its cache evicts the least recently *used*: a hot system prompt is stored
            # first and evicted last), and a wrong guess claims a block it does not hold. Dropped
            # whole, as a snapshot over the bound is; the memory goes with it.
            del self._precise[replica]
            raise IndexOverflow(replica, len(blocks), limit)
        for sent in (entry.pending, entry.unreported):
            if sent is not None:
                # Stored: the events say from now on whether it is held (a later eviction included).
                table = sent.expires
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
                if precise.unreported is not None:
                    table = precise.unreported.expires
                    for h in unseen:  # on its way again: pending, one table per hash
                        table.pop(h, None)
            return
        # One entry per block size. The replica's own model's requests all carry one; another
        # model's request that falls back there carries its model's. With one entry per
        # replica (until 2026-12-07) such a send replaced it, and every block the replica's own
        # model had noted there was lost (its hashes cover other token spans: never matched).
        sizes = self._approximate.setdefault(replica, {})
        entry = sizes.get(block_size)
        if entry is None:
            entry = sizes[block_size] = ApproximateEntry(block_size)
        self._remember(entry, block_hashes)
        if len(sizes) > 1:
            now = self._clock()
            for size, other in list(sizes.items()):
                if other is not entry:
                    self._expire(other, now)
                    if not other.expires:
                        del sizes[size]  # gone once all of it expired: no empty entry per size

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
        entry = self._approximate.get(replica, {}).get(block_size)
        if entry is not None:
            for h in block_hashes:
                entry.expires.pop(h, None)

    def prefilled(self, replica: str, block_size: int, block_hashes: Sequence[int]) -> None:
        """A request ``record_sent`` noted got its first token there: its prompt was prefilled,
        so none of its blocks is on its way any more. Those an event stored are the events' to
        rule. Those still pending were prefilled under hashes no event names (a second model
        whose tokenizer is not the router's, an older replica that ignores the cache salt) or
        their event is still on its way: they stay held for the TTL, as the approximate mode
        holds what was sent, but are no longer another prompt's queued prefill. Left pending,
        each counted as queued prefill for the whole TTL (120 s): a second model's replica
        looked seconds busy after every request it had served, and got fewer of the next."""
        if not block_hashes or block_size <= 0:
            return
        precise = self._precise.get(replica)
        if precise is None or precise.stale or precise.pending is None or block_size != precise.block_size:
            return
        table = precise.pending.expires
        done = [h for h in block_hashes if table.pop(h, None) is not None]
        if done:
            if precise.unreported is None:
                precise.unreported = ApproximateEntry(block_size)
            # Held from the prefill on: the replica had them then, which is later than the send.
            self._remember(precise.unreported, done)

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
            blocks, pending, unreported = entry.blocks, entry.pending, entry.unreported
            if (pending is None or not pending.expires) and (unreported is None or not unreported.expires):
                return _walk(blocks, block_hashes)  # the usual case once the events caught up
            sent = [t.expires for t in (pending, unreported) if t is not None and t.expires]
            # Held or sent there: a sent block, then held ones after it, all count.
            now, n = self._clock(), 0
            while n < len(block_hashes):
                held = _walk(blocks, block_hashes[n:])
                n += held
                went = _walk_sent(sent, block_hashes, now, n) - n
                n += went
                if not held and not went:
                    break
            return n
        sizes = self._approximate.get(replica)
        if not sizes:
            return 0
        now = self._clock()
        if block_size:
            approx = sizes.get(block_size)
            return 0 if approx is None else _walk_live(approx.expires, block_hashes, now)
        return max(_walk_live(e.expires, block_hashes, now) for e in sizes.values())

    def pending_tokens_outside(self, replica: str, block_hashes: Sequence[int]) -> int:
        """Prompt tokens this router sent to ``replica`` that it has not stored yet (prefill queued
        or under way there), less those in ``block_hashes``: the cold prefills another request
        would wait behind. Blocks of its own chain are work it needs done anyway (it counts them as
        held), so a burst behind one new prefix still queues where the prefix is on its way, while
        another prefix's request sees seconds of prefill ahead of it there. 0 without a fresh
        precise entry: the approximate mode cannot tell a queued prefill from a finished one.
        Blocks whose request was prefilled (``prefilled``) are not on their way: not counted."""
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
        now = self._clock()
        count = 0
        for approx in self._approximate.get(replica, {}).values():
            self._expire(approx, now)
            count += len(approx.expires)
        return count

    def replicas(self) -> list[str]:
        """Every replica with an entry of either kind."""
        return sorted(self._precise.keys() | self._approximate.keys())


def _carried(sent: ApproximateEntry | None, held: set[int], now: float) -> ApproximateEntry | None:
    """``sent``'s hashes that are live and not in ``held``, with their expiry and order (what a
    snapshot keeps of the blocks sent there; see ``PrefixIndex.apply_snapshot``)."""
    if sent is None:
        return None
    kept = ApproximateEntry(sent.block_size)
    table = kept.expires
    for h, expires in sent.expires.items():
        if expires > now and h not in held:
            table[h] = expires
    return kept if table else None
