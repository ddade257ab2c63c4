"""Keeps the running mesh's children up: a child that exits is restarted on its port, with backoff.

The launcher calls :meth:`Supervisor.step` twice a second once the mesh is up. Each
child is in one of three states: running, waiting out its backoff, or restarted and
not yet ready (health SERVING, or its TCP port for Redis and the gateway). The rest
of the mesh keeps serving meanwhile: the router health-checks its replicas and fails
over, and its clients reconnect to a restarted router by themselves. When
:class:`~services.launcher.supervision.RestartPolicy` gives up on a child, ``step``
raises :class:`ChildGaveUp` and the launcher stops everything.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.launcher.supervision import GiveUp, RestartPolicy, RestartTracker


class Supervised(Protocol):
    """What the supervisor needs of a child (``ChildProcess``, or a fake in tests)."""

    name: str
    log_path: Path

    @property
    def pid(self) -> int | None: ...

    @property
    def returncode(self) -> int | None: ...

    def alive(self) -> bool: ...
    def ready_now(self) -> bool: ...
    def restart(self) -> None: ...
    def kill_leftovers(self) -> None: ...
    def tail(self) -> str: ...


class ChildGaveUp(RuntimeError):
    """A child kept crashing after its restarts: the launcher stops the mesh."""


def describe_exit(returncode: int | None) -> str:
    """``signal 9 (SIGKILL)`` or ``code 3``: how a child ended, in its log line."""
    if returncode is None:
        return "without an exit status"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            return f"with signal {-returncode}"
        return f"with signal {-returncode} ({name})"
    return f"with code {returncode}"


@dataclass
class _Watch:
    child: Supervised
    tracker: RestartTracker
    #: None while it runs; otherwise when the pending restart is due.
    restart_at: float | None = None
    #: When it was last restarted, while it is not ready yet.
    starting_since: float | None = None


class Supervisor:
    def __init__(
        self,
        children: Iterable[Supervised],
        policy: RestartPolicy,
        say: Callable[[str], None],
        ready_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_ready: Callable[[Supervised], None] = lambda child: None,
    ) -> None:
        self.say = say
        self.ready_timeout_s = ready_timeout_s
        self.clock = clock
        self.on_ready = on_ready
        now = clock()
        self._watches: list[_Watch] = []
        for child in children:
            tracker = RestartTracker(policy)
            tracker.serving(now)  # `up` only supervises a mesh whose every child is ready
            self._watches.append(_Watch(child, tracker))

    def step(self) -> None:
        for watch in self._watches:
            self._step(watch, self.clock())

    def _step(self, watch: _Watch, now: float) -> None:
        child = watch.child
        if watch.restart_at is not None:
            if now >= watch.restart_at:
                watch.restart_at = None
                watch.starting_since = now
                watch.tracker.started()
                try:
                    child.restart()
                except OSError as exc:  # cannot even spawn it (a deleted venv, no memory to fork)
                    raise ChildGaveUp(f"{child.name} could not be restarted: {exc}") from exc
            return
        if not child.alive():
            self._crashed(watch, now, f"exited {describe_exit(child.returncode)}")
            return
        if watch.starting_since is None:
            return
        if child.ready_now():
            watch.starting_since = None
            watch.tracker.serving(now)
            self.say(
                f"llm-mesh: {child.name} is serving again (pid {child.pid}, restart {watch.tracker.restarts})"
            )
            self.on_ready(child)
        elif now - watch.starting_since > self.ready_timeout_s:
            # Started but never ready: as good as a crash, and it must not keep its port.
            child.kill_leftovers()
            self._crashed(watch, now, f"was not ready {self.ready_timeout_s:.0f} s after its restart")

    def _crashed(self, watch: _Watch, now: float, what: str) -> None:
        child = watch.child
        child.kill_leftovers()  # an engine worker it forked must not hold the port for the restart
        watch.starting_since = None
        decision = watch.tracker.exited(now)
        if isinstance(decision, GiveUp):
            raise ChildGaveUp(
                f"{child.name} {what}; giving up: {decision.reason}. "
                f"Last lines of {child.log_path}:\n{child.tail()}"
            )
        self.say(
            f"llm-mesh: {child.name} {what}; restarting in {decision.delay_s:g} s (restart {decision.number})"
        )
        watch.restart_at = now + decision.delay_s
