"""Passive outlier ejection: a replica's failure streak and when it is ejected (pure, injected clock).

Consecutive failures, TTFT timeouts and inter-token stalls count as failures;
enough in a row eject the replica for 30 s × (times ejected), like Envoy, but
never more than half the pool at once.
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

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ValueError("consecutive_failures must be >= 1")
        if self.base_ejection_s <= 0:
            raise ValueError("base_ejection_s must be > 0")


class OutlierDetector:
    """One replica's failure streak and ejection state."""

    def __init__(self, config: EjectionConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.consecutive_failures = 0
        self.ejection_count = 0
        self.ejected_until = 0.0
        self.last_failure: FailureKind | None = None

    @property
    def ejected(self) -> bool:
        return self._clock() < self.ejected_until

    def record_success(self) -> None:
        self.consecutive_failures = 0

    def record_failure(self, kind: FailureKind) -> bool:
        """Count a failure; True when the streak is long enough to eject."""
        self.consecutive_failures += 1
        self.last_failure = kind
        return self.consecutive_failures >= self.config.consecutive_failures and not self.ejected

    def eject(self) -> float:
        """Eject for base × n seconds (n = this ejection's number); returns the duration."""
        self.ejection_count += 1
        duration = self.config.base_ejection_s * self.ejection_count
        self.ejected_until = self._clock() + duration
        self.consecutive_failures = 0
        return duration

    def readmit(self) -> None:
        self.ejected_until = 0.0


def may_eject(ejected_now: int, pool_size: int, max_fraction: float) -> bool:
    """Whether one more ejection keeps the ejected share within ``max_fraction`` of the pool."""
    return pool_size > 0 and (ejected_now + 1) <= int(pool_size * max_fraction)
