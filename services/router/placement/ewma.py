"""Per-replica moving averages: latencies for WRT and the deadline filter, costs for the prefix policy."""

from __future__ import annotations

import time
from collections.abc import Callable


class LatencyEwma:
    """Exponentially weighted moving average that forgets when no sample arrives.

    A replica that was slow once would otherwise never be picked again and never
    get a chance to show it recovered; after ``stale_after_s`` without samples
    its value reads as unknown, which the balancer treats as average.
    """

    def __init__(
        self, alpha: float = 0.3, stale_after_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._value: float | None = None
        self._updated = 0.0

    def observe(self, sample: float) -> None:
        if self._value is None or self._clock() - self._updated > self.stale_after_s:
            self._value = sample
        else:
            self._value += self.alpha * (sample - self._value)
        self._updated = self._clock()

    @property
    def value(self) -> float | None:
        if self._value is None or self._clock() - self._updated > self.stale_after_s:
            return None
        return self._value

    @property
    def last_sample_at(self) -> float | None:
        """When the last sample arrived (on this EWMA's clock); None before the first."""
        return None if self._value is None else self._updated


class ReplicaCosts:
    """What one request costs on a replica, learned from the timings its answers report.

    Prefill seconds per uncached prompt token (the replica's ``prefill_ms`` over the prompt
    tokens its prefix cache did not cover) and decode seconds per request (``decode_ms``):
    the two terms of the prefix policy's predicted work. They forget after five minutes
    without samples, like the latencies, so a replica that got faster is not held to its past.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.prefill_per_token = LatencyEwma(alpha=0.2, stale_after_s=300.0, clock=clock)
        self.decode_per_request = LatencyEwma(alpha=0.2, stale_after_s=300.0, clock=clock)

    def observe(self, prompt_tokens: int, cached_tokens: int, prefill_s: float, decode_s: float) -> None:
        """One finished generation's usage and timings."""
        uncached = prompt_tokens - cached_tokens
        # A prompt the cache covered all but a few tokens of says little about per-token cost.
        if uncached >= 16 and prefill_s > 0:
            self.prefill_per_token.observe(prefill_s / uncached)
        if decode_s > 0:
            self.decode_per_request.observe(decode_s)
