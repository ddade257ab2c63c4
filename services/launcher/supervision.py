"""When to restart a crashed child, and when to stop trying: a pure policy (times are passed in).

A child that crashes is restarted after 1 s, then 2, 4, … up to 30 s while it keeps
crashing. Once it has served for ``stable_after_s`` its slate is wiped: the next
crash is again restart 1 after 1 s, so a replica that dies once a day never drifts
to 30 s waits. One that cannot stay up (``max_failed_restarts`` restarts in a row
that each crashed again without a stable run, within ``window_s``) is given up on: the launcher then
stops the mesh and says why, rather than restart-looping forever behind a mesh
that looks up.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    #: Serving this long counts as a good run: backoff and failure count start over.
    stable_after_s: float = 60.0
    #: Give up when this many restarts in a row crashed again within ``window_s``.
    max_failed_restarts: int = 5
    window_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("restart backoff: need 0 < initial <= max")
        if self.stable_after_s <= 0 or self.window_s <= 0:
            raise ValueError("restart policy: stable_after_s and window_s must be > 0")
        if self.max_failed_restarts < 1:
            raise ValueError("restart policy: max_failed_restarts must be >= 1")


@dataclass(frozen=True)
class Restart:
    delay_s: float
    #: How many times this child has been restarted, this one included (for the log line).
    number: int


@dataclass(frozen=True)
class GiveUp:
    reason: str


Decision = Restart | GiveUp


class RestartTracker:
    """One child's crash history under a :class:`RestartPolicy`."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.restarts = 0
        self._serving_since: float | None = None
        # Crash times since the last stable run (oldest first).
        self._crashes: deque[float] = deque()
        self.started()

    def started(self) -> None:
        """A (re)started process is on its way up; it has not served yet."""
        self._serving_since = None

    def serving(self, now: float) -> None:
        """Its health check answered: a stable run is measured from here."""
        if self._serving_since is None:
            self._serving_since = now

    def exited(self, now: float) -> Decision:
        """It exited on its own (or never became ready): restart it after a delay, or give up."""
        p = self.policy
        if self._serving_since is not None and now - self._serving_since >= p.stable_after_s:
            self._crashes.clear()
        self._serving_since = None
        self._crashes.append(now)
        while self._crashes and self._crashes[0] < now - p.window_s:
            self._crashes.popleft()
        # The first crash of a streak is the run that was fine until then; the rest are failed restarts.
        failed_restarts = len(self._crashes) - 1
        if failed_restarts >= p.max_failed_restarts:
            span = now - self._crashes[0]
            return GiveUp(
                f"restarted {failed_restarts} times in {span:.0f} s and it crashed again each time "
                f"before serving for {p.stable_after_s:.0f} s"
            )
        self.restarts += 1
        delay = min(p.initial_backoff_s * 2**failed_restarts, p.max_backoff_s)
        return Restart(delay_s=delay, number=self.restarts)
