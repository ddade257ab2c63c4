"""Where tasks live in Redis: the key layout, the work queue's consumer group, the event fields.

Layout (``<id>`` in braces is a Redis Cluster hash tag, so one task's keys share a slot):

- ``llm:tasks:stream`` — the work queue (a Stream; consumer group ``routers``).
  An entry stays pending until the router that ran it acknowledges it, so a
  router killed mid-task leaves it pending, and another router takes it over
  with XAUTOCLAIM once it has been idle past the visibility timeout.
- ``llm:task:{<id>}`` — hash: state, tenant, key id, request bytes, end bytes,
  error, timestamps, attempts, cancel flag.
- ``llm:task:{<id>}:text`` — the answer so far (APPEND per delta).
- ``llm:task:{<id>}:tokens`` — its token ids so far (little-endian int32, APPEND per delta, in
  the same transaction as the text): with the hash's ``checkpoint`` (the turn's prompt as
  built, its model and session version, saved before the first token) a router that takes
  the task over continues the answer after them instead of starting it again.
- ``llm:task:{<id>}:events`` — Stream of state snapshots and token deltas that
  WatchTask follows.

All four expire ``result_ttl_s`` after the task ends.

- ``llm:tasks:open:<tenant>`` — sorted set of the tenant's unfinished task ids
  (score: created ms). A task joins it when it is created and leaves it in the
  same script that moves it to a final state; its size is the tenant's count
  against ``max_open_per_tenant``.

The create and transition scripts also touch the work queue and the tenant's
open set, so on a Redis Cluster (``--redis-cluster``) every task key carries one
hash tag, ``llm:{tasks}:…`` (``CLUSTER_KEYS``): all task data lives in one slot, as
BullMQ lays out its queues. One Redis primary keeps the names above
(``STANDALONE_KEYS``), so upgrading a standalone deployment moves no keys.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "routers"
# The fields of an entry of a task's event stream, and its two kinds (the scripts write them too).
EVENT_KIND = b"k"
EVENT_PAYLOAD = b"p"
KIND_TASK = b"task"
KIND_DELTA = b"delta"


@dataclass(frozen=True)
class TaskKeys:
    """Where tasks live in Redis; every router sharing one Redis must use the same layout."""

    # "llm": the names in the module docstring. A prefix holding a hash tag ("llm:{tasks}")
    # puts every key below in one Redis Cluster slot: the scripts touch several at once.
    prefix: str = "llm"

    @property
    def stream(self) -> str:
        """The work queue."""
        return f"{self.prefix}:tasks:stream"

    def task(self, task_id: str) -> str:
        return f"{self.prefix}:task:{{{task_id}}}"

    def text(self, task_id: str) -> str:
        return f"{self.prefix}:task:{{{task_id}}}:text"

    def tokens(self, task_id: str) -> str:
        return f"{self.prefix}:task:{{{task_id}}}:tokens"

    def events(self, task_id: str) -> str:
        return f"{self.prefix}:task:{{{task_id}}}:events"

    def open_tasks(self, tenant: str) -> str:
        return f"{self.prefix}:tasks:open:{tenant}"

    def open_bytes(self, tenant: str) -> str:
        """Hash: each of the tenant's unfinished task ids -> its request's size in bytes."""
        return f"{self.prefix}:tasks:openbytes:{tenant}"

    def idempotency(self, tenant: str, key: str) -> str:
        # The tenant's length first: tenant "a" with key "b:c" and tenant "a:b" with key "c" were
        # one key, so one tenant could block another's submits and learn its task ids.
        return f"{self.prefix}:task:idem:{len(tenant)}:{tenant}:{key}"


STANDALONE_KEYS = TaskKeys("llm")
# Redis uses the first {…} of a key as its hash tag, so the per-task tags after it no longer count.
CLUSTER_KEYS = TaskKeys("llm:{tasks}")
