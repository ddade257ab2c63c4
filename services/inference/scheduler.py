"""Continuous-batching policy: each step picks who runs and how many tokens each computes.

Pure Python (no torch). Running sequences go first (decodes and unfinished
prefill chunks), then waiting ones are admitted while the token budget, the
sequence cap and the KV blocks allow. A waiting request reuses cached prefix
blocks, including blocks a prefill chunk earlier in the same step is filling. A long prompt is split into chunks so it
never stalls running decodes. When blocks run out, the most recently admitted
running sequence is preempted (its KV is dropped and recomputed later).
A sequence whose reader stopped taking its tokens is *parked*: out of the batch
and the queue, its KV dropped (its prefix stays cached), until the reader is back.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from services.inference.block_manager import BlockManager
from services.inference.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: compute tokens [start, start + num_tokens)."""

    seq: Sequence
    start: int
    num_tokens: int
    # Admitted from the waiting queue in this step: its matched prefix may include
    # blocks another chunk of this same step is still filling.
    admitted: bool = False

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token is drawn."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """What one engine step runs, and what the scheduler decided on the side."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    # Sequences pushed back to waiting this step (their KV was dropped).
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences the scheduler ended itself (e.g. can never fit in the KV cache).
    errored: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue and the running batch."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        #: request id -> sequence held out of scheduling until its reader catches up (``park``).
        self.parked: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether a step has work: parked sequences have none until they are unparked."""
        return bool(self.waiting or self.running)

    def park(self, seq: Sequence) -> None:
        """Hold ``seq`` out of scheduling: nobody reads its tokens. A running one gives back its seat
        and its KV blocks (full ones stay cached, so ``unpark`` recomputes little)."""
        if seq.is_finished or seq.request_id in self.parked:
            return
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            seq.num_preemptions += 1  # re-admission must not re-count its prefix as cached prompt
        elif seq in self.waiting:
            self.waiting.remove(seq)  # waiting sequences hold no blocks
        else:
            return
        self.parked[seq.request_id] = seq

    def unpark(self, seq: Sequence) -> None:
        """Schedule ``seq`` again, ahead of the queue (it was admitted before everyone waiting)."""
        if self.parked.pop(seq.request_id, None) is not None:
            self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.monotonic()

        # 1. The running batch, oldest first. Decodes need one token, so they are
        # never starved by a chunk of a long prompt further down the list.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate(seq, n):
                victim = self.running.pop()  # newest first: least work lost
                if victim is seq and i == 0:
                    # Alone and still no room: it can never grow in this cache.
                    self._fail(seq, "ran out of KV-cache blocks with no other sequence to preempt")
                    out.errored.append(seq)
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._schedule(out, seq, n)
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: nothing after it can run either

        # 2. Admit waiting sequences, unless this step already had to preempt.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            if not self.block_manager.can_ever_fit(seq.num_tokens + 1):
                self.waiting.popleft()
                self._fail(
                    seq,
                    f"needs more KV-cache blocks than exist ({self.block_manager.num_blocks} "
                    f"blocks of {self.block_manager.block_size} tokens)",
                )
                out.errored.append(seq)
                continue
            # A request scored over its prompt needs every position's logits: nothing cached.
            cached = self.block_manager.match_prefix(seq, reuse=seq.prompt_logprobs is None)
            seq.num_computed_tokens = cached
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = cached
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.allocate(seq, n):
                # Waiting sequences hold no blocks (else they could starve the running
                # batch); its prefix stays cached and is matched again next time.
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            self._schedule(out, seq, n, admitted=True)
            budget -= n
        return out

    def _schedule(self, out: SchedulerOutput, seq: Sequence, n: int, admitted: bool = False) -> None:
        start = seq.num_computed_tokens
        out.scheduled.append(ScheduledSequence(seq, start, n, admitted))
        if n > 1:
            # In-step prefix sharing: the blocks this prefill chunk fills are offered at
            # once, so waiting requests with the same prefix (64 chats behind one system
            # prompt) compute it once in this step instead of once each. Only prefill
            # chunks: the runner writes their K/V before any row of the step attends.
            self.block_manager.commit(seq, start + n)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def discard_filled(self, chunk: ScheduledSequence) -> list[Sequence]:
        """After ``chunk``'s forward failed: forget the blocks it was filling as prefixes (their
        K/V may be garbage) and preempt every other running sequence that already holds one
        (matched within the same step); those compute their prefix again. Returns them.

        Such a sequence's own blocks from the first garbage one on were computed over it, so
        they are forgotten too, and so on for any sequence that matched those in the step:
        freed with their hashes, they stayed cached prefixes with wrong K/V, served to every
        later request with that prompt (its recompute could not replace them: the hash was
        taken)."""
        seq = chunk.seq
        bs = self.block_manager.block_size
        suspect = set(seq.block_table[chunk.start // bs : (chunk.start + chunk.num_tokens - 1) // bs + 1])
        victims: list[Sequence] = []
        while True:
            more = [
                s
                for s in self.running
                if s is not seq and s not in victims and not suspect.isdisjoint(s.block_table)
            ]
            if not more:
                break
            for victim in more:
                first = next(i for i, b in enumerate(victim.block_table) if b in suspect)
                suspect.update(victim.block_table[first:])
            victims += more
        self.block_manager.forget(suspect)
        for victim in victims:
            self.running.remove(victim)
            self._preempt(victim)
        return victims

    def _fail(self, seq: Sequence, error: str) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED_ERROR
        seq.error = error
        seq.finished_time = time.monotonic()

    def advance(self, scheduled: ScheduledSequence) -> None:
        """Record that the runner computed this chunk; its full blocks become reusable."""
        seq = scheduled.seq
        seq.num_computed_tokens = scheduled.start + scheduled.num_tokens
        self.block_manager.commit(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End ``seq`` (running or waiting) and release its blocks."""
        seq.status = status
        seq.finished_time = time.monotonic()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.parked.pop(seq.request_id, None)
        self.block_manager.free(seq)
