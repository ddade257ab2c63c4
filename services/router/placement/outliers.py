"""Passive outlier ejection: a replica's failure streak and when it is ejected (pure, injected clock).

Consecutive failures, TTFT timeouts and inter-token stalls count as failures;
enough in a row eject the replica for 30 s × (times ejected), at most 300 s, like
Envoy (whose multiplier also falls again while the host stays healthy), but never
more than half of a model's replicas are out at once, counting those not serving.
Failures while ejected do not count: the streak starts again when it comes back.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass


class FailureKind(enum.Enum):
    """What went wrong on a call to a replica."""

    ERROR = "error"
    TTFT_TIMEOUT = "ttft_timeout"
    STALL = "stall"


@dataclass(frozen=True)
class EjectionConfig:
    """Outlier-detection settings."""

    consecutive_failures: int = 3
    base_ejection_s: float = 30.0
    max_ejected_fraction: float = 0.5
    #: The longest one ejection lasts (Envoy's max_ejection_time): without it a replica that
    #: failed now and then was out for longer each time, without end.
    max_ejection_s: float = 300.0

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ValueError("consecutive_failures must be >= 1")
        if self.base_ejection_s <= 0:
            raise ValueError("base_ejection_s must be > 0")
        if self.max_ejection_s < self.base_ejection_s:
            raise ValueError("max_ejection_s must be >= base_ejection_s")


class OutlierDetector:
    """One replica's failure streak and ejection state."""

    def __init__(self, config: EjectionConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.consecutive_failures = 0
        self.ejection_count = 0
        self.ejected_until = 0.0
        self.last_failure: FailureKind | None = None
        # When a success next lowers ejection_count by one: a base ejection's time after the
        # last ejection ended, then one more such interval for each further step down.
        self._forgive_at = 0.0

    @property
    def ejected(self) -> bool:
        return self._clock() < self.ejected_until

    def record_success(self) -> None:
        self.consecutive_failures = 0
        now = self._clock()
        if self.ejection_count and now >= self._forgive_at and not self.ejected:
            self.ejection_count -= 1
            self._forgive_at = now + self.config.base_ejection_s

    def record_failure(self, kind: FailureKind) -> bool:
        """Count a failure; True when the streak is long enough to eject. While ejected, nothing
        counts (streams it still had, health probes): it comes back with a clean streak."""
        self.last_failure = kind
        if self.ejected:
            return False
        self.consecutive_failures += 1
        return self.consecutive_failures >= self.config.consecutive_failures

    def eject(self) -> float:
        """Eject for base × n seconds (n = this ejection's number), at most ``max_ejection_s``;
        returns the duration."""
        self.ejection_count += 1
        duration = min(self.config.base_ejection_s * self.ejection_count, self.config.max_ejection_s)
        self.ejected_until = self._clock() + duration
        self._forgive_at = self.ejected_until + self.config.base_ejection_s
        self.consecutive_failures = 0
        return duration

    def readmit(self) -> None:
        self.ejected_until = 0.0


def may_eject(ejected_now: int, pool_size: int, max_fraction: float) -> bool:
    """Whether one more ejection keeps the share out of service within ``max_fraction`` of the
    pool (``ejected_now``: those already out, by ejection or not serving)."""
    return pool_size > 0 and (ejected_now + 1) <= int(pool_size * max_fraction)
