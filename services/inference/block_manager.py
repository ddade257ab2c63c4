"""Paged KV-cache bookkeeping: block tables, prefix reuse by chained block hash, refcounts, LRU eviction.

Pure Python: it hands out block ids; the model runner owns the tensors they index. The block
hash is the mesh-wide one (``services/common/kv_blocks.py``), so the router computes the same
numbers; every hash registered or dropped is recorded in ``events`` (``kv_events.py``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from services.common.kv_blocks import chain_hash, salt_seed
from services.inference.kv_events import KvEventLog
from services.inference.sequence import Sequence


@dataclass
class Block:
    """One fixed-size page of KV slots."""

    block_id: int
    ref_count: int = 0
    # Set once the block is full and computed: the chained hash of its tokens and
    # every token before it, and the tokens themselves (to rule out hash collisions).
    block_hash: int | None = None
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class BlockUsage:
    """A snapshot of the pool for load reports."""

    used: int
    cached: int
    total: int


class BlockManager:
    """Owns ``num_blocks`` blocks of ``block_size`` token slots each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # A stack, lowest ids on top: a fresh pool hands out blocks 0, 1, 2, ...
        self._free: deque[int] = deque(reversed(range(num_blocks)))
        # Unreferenced blocks that still hold a reusable prefix, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[int, int] = {}
        # Per sequence: hashes of its full, registered blocks (the chain so far).
        self._seq_hashes: dict[str, list[int]] = {}
        #: Every hash entering or leaving ``_by_hash``: the replica's KV events.
        self.events = KvEventLog(block_size)

    # -- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable)."""
        return len(self._free) + len(self._evictable)

    def usage(self) -> BlockUsage:
        free = self.num_free_blocks
        return BlockUsage(used=self.num_blocks - free, cached=len(self._evictable), total=self.num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_blocks

    # -- prefix cache ----------------------------------------------------------
    def match_prefix(self, seq: Sequence, reuse: bool = True) -> int:
        """Attach cached blocks holding ``seq``'s prefix; returns how many tokens they cover.

        Only whole blocks match, and never the last token: the model must run on at
        least one token to produce logits. ``reuse`` False: none match (the sequence needs
        every prompt position's logits), though its own blocks are offered to others as usual.
        """
        assert not seq.block_table, "prefix matching is only for a sequence with no blocks"
        hashes: list[int] = []
        parent = salt_seed(seq.cache_salt)
        limit = (seq.num_tokens - 1) // self.block_size if reuse else 0
        for i in range(limit):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            block_id = self._by_hash.get(h)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            hashes.append(h)
            parent = h
        self._seq_hashes[seq.request_id] = hashes
        return len(hashes) * self.block_size

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)
        block.ref_count += 1

    def commit(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Register ``seq``'s full blocks among its first ``num_tokens`` for reuse by later requests.

        ``num_tokens`` defaults to the computed tokens. The scheduler passes the end of a
        chunk it has just scheduled, so sequences admitted later in the same step share
        those blocks; the runner writes a step's prefill K/V before any row attends.
        """
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        upto = seq.num_computed_tokens if num_tokens is None else num_tokens
        full = min(upto // self.block_size, len(seq.block_table))
        while len(hashes) < full:
            i = len(hashes)
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(hashes[-1] if hashes else salt_seed(seq.cache_salt), tokens)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and h not in self._by_hash:
                block.block_hash = h
                block.tokens = tokens
                self._by_hash[h] = block.block_id
                self.events.stored(h)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix held by no sequence (benchmarks start each round cold)."""
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            block.block_hash = None
            block.tokens = ()
            self._free.append(block_id)
        kept: dict[int, int] = {}
        for h, b in self._by_hash.items():
            if self.blocks[b].ref_count > 0:
                kept[h] = b
            else:
                self.events.evicted(h)
        self._by_hash = kept

    def forget(self, block_ids: set[int]) -> None:
        """Stop offering these blocks as cached prefixes (their contents cannot be trusted)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            self._unregister(block)

    def _unregister(self, block: Block) -> None:
        """The block no longer holds a reusable prefix."""
        h = block.block_hash
        if h is not None and self._by_hash.get(h) == block.block_id:
            del self._by_hash[h]
            self.events.evicted(h)
        block.block_hash = None
        block.tokens = ()

    # -- allocation ------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more computed tokens; False (nothing taken) if no room."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._pop_free())
        return True

    def _pop_free(self) -> int:
        if self._free:
            # Most recently freed first: its pages are resident and likely still in cache
            # (the CPU cache is mapped lazily, so a never-used block costs page faults).
            block_id = self._free.pop()
        else:
            # Evict the least recently used cached prefix.
            block_id, _ = self._evictable.popitem(last=False)
            self._unregister(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; hashed ones stay cached (evictable) for prefix reuse."""
        # Reverse order: a prefix's tail is evicted before its head, keeping heads reusable longer.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)
        seq.block_table = []
        self._seq_hashes.pop(seq.request_id, None)
