"""`llm-mesh up`'s supervision without processes: the restart policy, and the supervisor on fake children and a fake clock."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from services.launcher.supervision import GiveUp, Restart, RestartPolicy, RestartTracker
from services.launcher.supervisor import ChildGaveUp, Supervisor, describe_exit


def crash_loop(tracker: RestartTracker, times: int, now: float, runs_s: float = 2.0) -> list[float]:
    """Crash ``times`` times, each restart dying ``runs_s`` after its backoff; the delays asked for."""
    delays = []
    for _ in range(times):
        decision = tracker.exited(now)
        assert isinstance(decision, Restart)
        delays.append(decision.delay_s)
        now += decision.delay_s
        tracker.started()
        now += runs_s
    return delays


def test_backoff_doubles_from_one_second_up_to_thirty() -> None:
    tracker = RestartTracker(RestartPolicy(max_failed_restarts=10, window_s=10_000))
    assert crash_loop(tracker, 8, now=100.0) == [1, 2, 4, 8, 16, 30, 30, 30]
    assert tracker.restarts == 8


def test_gives_up_when_every_restart_crashes_again() -> None:
    tracker = RestartTracker(RestartPolicy(max_failed_restarts=3))
    tracker.serving(0.0)
    crash_loop(tracker, 3, now=100.0)  # the first crash, then two failed restarts
    decision = tracker.exited(120.0)  # the third restart died too
    assert isinstance(decision, GiveUp)
    assert "restarted 3 times" in decision.reason and "before serving for 60 s" in decision.reason


def test_a_stable_run_starts_the_backoff_and_the_count_over() -> None:
    tracker = RestartTracker(RestartPolicy(max_failed_restarts=3))
    assert crash_loop(tracker, 3, now=0.0) == [1, 2, 4]
    # The third restart came up and served for over a minute: its crash is a fresh start.
    tracker.serving(20.0)
    first = tracker.exited(90.0)
    assert first == Restart(delay_s=1, number=4)
    # Serving briefly is not enough: the streak goes on.
    tracker.started()
    tracker.serving(92.0)
    assert tracker.exited(100.0) == Restart(delay_s=2, number=5)


def test_crashes_older_than_the_window_are_forgotten() -> None:
    policy = RestartPolicy(max_failed_restarts=2, window_s=60.0)
    tracker = RestartTracker(policy)
    assert tracker.exited(0.0) == Restart(delay_s=1, number=1)
    assert tracker.exited(10.0) == Restart(delay_s=2, number=2)
    # Two failed restarts within a minute would give up; these are minutes apart.
    assert isinstance(tracker.exited(200.0), Restart)
    assert isinstance(tracker.exited(400.0), Restart)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"initial_backoff_s": 0}, "backoff"),
        ({"initial_backoff_s": 40}, "backoff"),
        ({"max_failed_restarts": 0}, "max_failed_restarts"),
        ({"stable_after_s": 0}, "stable_after_s"),
    ],
)
def test_policy_rejects_nonsense(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


def test_exit_statuses_read_as_a_user_would_say_them() -> None:
    assert describe_exit(-signal.SIGKILL) == "with signal 9 (SIGKILL)"
    assert describe_exit(3) == "with code 3"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeChild:
    """A child whose death, restarts and readiness the test decides."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.log_path = Path(f"/logs/{name}.log")
        self.pid: int | None = 100
        self.returncode: int | None = None
        self.ready = True
        self.restarts = 0
        self.leftovers_killed = 0

    def alive(self) -> bool:
        return self.returncode is None

    def ready_now(self) -> bool:
        return self.ready

    def restart(self) -> None:
        self.restarts += 1
        self.pid = 100 + self.restarts
        self.returncode = None

    def kill_leftovers(self) -> None:
        self.leftovers_killed += 1

    def tail(self) -> str:
        return "Traceback …\nRuntimeError: CUDA out of memory"


def supervise(
    *children: FakeChild, policy: RestartPolicy | None = None
) -> tuple[Supervisor, FakeClock, list[str], list[str]]:
    clock, said, ready = FakeClock(), [], []
    supervisor = Supervisor(
        children,
        policy or RestartPolicy(),
        say=said.append,
        ready_timeout_s=600,
        clock=clock,
        on_ready=lambda child: ready.append(child.name),
    )
    return supervisor, clock, said, ready


def test_a_killed_replica_is_restarted_after_its_backoff_and_announced_when_back() -> None:
    victim, survivor = FakeChild("inference-1"), FakeChild("inference-0")
    supervisor, clock, said, ready = supervise(survivor, victim)
    supervisor.step()
    assert said == []
    victim.returncode = -signal.SIGKILL
    victim.ready = False
    supervisor.step()
    assert said == ["llm-mesh: inference-1 exited with signal 9 (SIGKILL); restarting in 1 s (restart 1)"]
    assert victim.leftovers_killed == 1
    clock.now += 0.5
    supervisor.step()
    assert victim.restarts == 0  # still in its backoff
    clock.now += 0.5
    supervisor.step()
    assert victim.restarts == 1 and victim.alive()
    clock.now += 20  # loading its model
    supervisor.step()
    assert len(said) == 1 and ready == []
    victim.ready = True
    supervisor.step()
    assert said[-1] == "llm-mesh: inference-1 is serving again (pid 101, restart 1)"
    assert ready == ["inference-1"]
    assert survivor.restarts == 0 and survivor.leftovers_killed == 0


def test_a_child_that_keeps_crashing_stops_the_mesh_with_its_last_words() -> None:
    child = FakeChild("inference-0")
    supervisor, clock, said, _ = supervise(child, policy=RestartPolicy(max_failed_restarts=2))
    child.returncode = 1
    supervisor.step()
    clock.now += 1
    supervisor.step()  # restarted …
    child.returncode = 1  # … and dies while loading
    supervisor.step()
    assert [line.split("; ")[1] for line in said] == [
        "restarting in 1 s (restart 1)",
        "restarting in 2 s (restart 2)",
    ]
    clock.now += 2
    supervisor.step()
    child.returncode = 1  # the second restart fails too
    with pytest.raises(ChildGaveUp) as failure:
        supervisor.step()
    message = str(failure.value)
    assert message.startswith("inference-0 exited with code 1; giving up: restarted 2 times")
    assert "/logs/inference-0.log" in message and "CUDA out of memory" in message


def test_a_restart_that_never_becomes_ready_counts_as_a_crash() -> None:
    child = FakeChild("retriever")
    supervisor, clock, said, _ = supervise(child, policy=RestartPolicy(window_s=3600))
    child.returncode = -signal.SIGTERM
    supervisor.step()
    clock.now += 1
    supervisor.step()
    child.ready = False
    clock.now += 601
    supervisor.step()
    assert (
        said[-1] == "llm-mesh: retriever was not ready 600 s after its restart; restarting in 2 s (restart 2)"
    )
    assert child.leftovers_killed >= 2
