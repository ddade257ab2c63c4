"""How the task worker behaves: its settings and the router flags (``LLMMESH_TASK_*``) they come from."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.settings import EnvArgumentParser, add_flags, flag, from_flags


@dataclass(frozen=True)
class TaskSettings:
    """How the task worker behaves; every router of a deployment should agree on these."""

    result_ttl_s: int = flag(600, name="--task-result-ttl-seconds", help="keep task results this long")
    # An entry unacknowledged this long belongs to a dead router and is taken over.
    visibility_timeout_s: float = flag(
        30.0,
        name="--task-visibility-seconds",
        help="take over a task another router left unacknowledged this long",
    )
    concurrency: int = flag(4, name="--task-concurrency", help="tasks this router runs at once")
    # A task whose runs keep killing routers is failed instead of retried forever.
    max_attempts: int = flag(3, name="--task-max-attempts", help="runs of one task before it fails")
    block_ms: int = 1000
    # How long a task waits in all for its key's rate limit before failing.
    overload_wait_s: float = 300.0
    # Unfinished (queued or running) tasks one tenant may have: one tenant must not fill the queue.
    max_per_tenant: int = flag(
        1000,
        name="--task-max-per-tenant",
        help="unfinished tasks one tenant may have; more are refused RESOURCE_EXHAUSTED (0 = no cap)",
    )
    # Entries the shared work queue may hold; beyond it submissions are refused, never dropped.
    max_queued: int = flag(
        100_000,
        name="--task-max-queued",
        help="tasks queued or running in all; more are refused RESOURCE_EXHAUSTED (0 = no cap)",
    )

    # What one tenant's unfinished tasks may hold in Redis, their requests (up to 4 MiB each) summed:
    # a count alone let one tenant keep its 1,000 tasks' worth, 4 GiB, of prompts there.
    max_bytes_per_tenant: int = flag(
        256 * 1024 * 1024,
        name="--task-max-bytes-per-tenant",
        help="bytes of requests one tenant's unfinished tasks may hold; more are refused RESOURCE_EXHAUSTED"
        " (0 = no cap)",
    )

    def __post_init__(self) -> None:
        if self.result_ttl_s < 1:
            raise ValueError(f"--task-result-ttl-seconds: must be >= 1, got {self.result_ttl_s}")
        if self.visibility_timeout_s <= 0:
            raise ValueError(f"--task-visibility-seconds: must be > 0, got {self.visibility_timeout_s}")
        if self.concurrency < 1:
            raise ValueError(f"--task-concurrency: must be >= 1, got {self.concurrency}")
        if self.max_attempts < 1:
            raise ValueError(f"--task-max-attempts: must be >= 1, got {self.max_attempts}")
        if self.max_per_tenant < 0:
            raise ValueError(f"--task-max-per-tenant: must be >= 0 (0 = no cap), got {self.max_per_tenant}")
        if self.max_bytes_per_tenant < 0:
            raise ValueError(
                f"--task-max-bytes-per-tenant: must be >= 0 (0 = no cap), got {self.max_bytes_per_tenant}"
            )
        if self.max_queued < 0:
            raise ValueError(f"--task-max-queued: must be >= 0 (0 = no cap), got {self.max_queued}")

    @classmethod
    def from_env(cls) -> TaskSettings:
        """Settings from the same ``LLMMESH_TASK_*`` variables the router flags default to."""
        parser = EnvArgumentParser(add_help=False)
        add_task_arguments(parser)
        return cls.from_args(parser.parse_args([]))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TaskSettings:
        return from_flags(cls, args)


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """Router flags for the task worker (the router's __main__ adds them)."""
    add_flags(parser, TaskSettings)
