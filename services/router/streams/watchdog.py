"""The relay's stall detection: a generation that sends nothing for too long fails, one timer per check."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.router.placement.outliers import FailureKind
from services.router.placement.pool import GenerationStream
from services.router.streams.attempts import AttemptFailed


class Watchdog:
    """Fails a generation that sends nothing for too long, with one timer per check, not per token."""

    __slots__ = (
        "_handle",
        "_loop",
        "clock",
        "generation",
        "last_progress",
        "stall_s",
        "started",
        "ttft_blames_replica",
        "ttft_s",
        "with_client",
    )

    def __init__(
        self,
        generation: GenerationStream,
        ttft_s: float,
        stall_s: float,
        clock: Callable[[], float],
        ttft_blames_replica: bool = True,
    ) -> None:
        self.generation = generation
        #: False for a generation with an output constraint: its first token waits for the grammar
        #: to compile (seconds for a big schema, queued behind others' compiles), which says
        #: nothing of the replica's health. It still times out and is tried elsewhere, but is not
        #: counted towards ejecting a replica that is only busy compiling (the one-token health
        #: probe, unconstrained, still finds a wedged one).
        self.ttft_blames_replica = ttft_blames_replica
        self.ttft_s = ttft_s
        self.stall_s = stall_s
        self.clock = clock
        self.last_progress = clock()
        self.started = False
        #: The relay is handing a batch to its client: the replica's silence meanwhile is not a stall.
        self.with_client = False
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(ttft_s, self._check)

    def _check(self) -> None:
        limit = self.stall_s if self.started else self.ttft_s
        idle = 0.0 if self.with_client else self.clock() - self.last_progress
        if idle >= limit:
            kind = FailureKind.STALL if self.started else FailureKind.TTFT_TIMEOUT
            blamed = self.started or self.ttft_blames_replica
            self.generation.fail(AttemptFailed(f"{kind.value} after {idle:.1f} s", kind if blamed else None))
            return
        self._handle = self._loop.call_later(limit - idle, self._check)

    def stop(self) -> None:
        self._handle.cancel()
