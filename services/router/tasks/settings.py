"""How the task worker behaves: its settings and the router flags (``LLMMESH_TASK_*``) they come from."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.settings import EnvArgumentParser


@dataclass(frozen=True)
class TaskSettings:
    """How the task worker behaves; every router of a deployment should agree on these."""

    result_ttl_s: int = 600
    # An entry unacknowledged this long belongs to a dead router and is taken over.
    visibility_timeout_s: float = 30.0
    concurrency: int = 4
    # A task whose runs keep killing routers is failed instead of retried forever.
    max_attempts: int = 3
    block_ms: int = 1000
    # How long a task waits in all for its key's rate limit before failing.
    overload_wait_s: float = 300.0
    # Unfinished (queued or running) tasks one tenant may have: one tenant must not fill the queue.
    max_per_tenant: int = 1000
    # Entries the shared work queue may hold; beyond it submissions are refused, never dropped.
    max_queued: int = 100_000

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
        return cls(
            result_ttl_s=args.task_result_ttl_seconds,
            visibility_timeout_s=args.task_visibility_seconds,
            concurrency=args.task_concurrency,
            max_attempts=args.task_max_attempts,
            max_per_tenant=args.task_max_per_tenant,
            max_queued=args.task_max_queued,
        )


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """Router flags for the task worker (the router's __main__ adds them)."""
    parser.add_argument(
        "--task-result-ttl-seconds", type=int, default=600, help="keep task results this long"
    )
    parser.add_argument(
        "--task-visibility-seconds",
        type=float,
        default=30.0,
        help="take over a task another router left unacknowledged this long",
    )
    parser.add_argument("--task-concurrency", type=int, default=4, help="tasks this router runs at once")
    parser.add_argument("--task-max-attempts", type=int, default=3, help="runs of one task before it fails")
    parser.add_argument(
        "--task-max-per-tenant",
        type=int,
        default=1000,
        help="unfinished tasks one tenant may have; more are refused RESOURCE_EXHAUSTED (0 = no cap)",
    )
    parser.add_argument(
        "--task-max-queued",
        type=int,
        default=100_000,
        help="tasks queued or running in all; more are refused RESOURCE_EXHAUSTED (0 = no cap)",
    )
