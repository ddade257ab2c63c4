"""The one OS thread that runs every torch call of a replica: loading, warm-up, the engine loop.

Why one thread, not "any thread that is free": on CPU, torch's intra-op parallelism is
OpenMP (GNU libgomp), and libgomp keeps a pool of worker threads *per thread that opened
a parallel region*. A replica that loaded its model on one executor thread, warmed up on
another and ran its loop on a third held three pools. Once libgomp manages more threads
than there are CPUs it throttles how long an idle worker spins before it sleeps (100
spins instead of ~300,000), so between two parallel regions the loop's one worker fell
asleep and every region began with a futex wake-up, which on a VM is a trip through the
hypervisor. Measured on the 2 vCPU VM during `bench/serving.py --rate 4`: the replica
used 1.3 of its 2 CPUs (engine thread 0.8, its worker 0.5); with every call on this
one thread, one pool, and the worker allowed to spin, it uses 1.85 (docs/inference.md, "One
engine thread"). Whether it may spin is the operator's call: openmp_policy.py.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

NAME = "llmmesh-engine"


class EngineThread:
    """A daemon thread that runs the calls handed to it one after another, in order."""

    def __init__(self, name: str = NAME) -> None:
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        """The OS-level thread id, as ``threading.get_ident()`` reports it inside a call."""
        return self._thread.ident

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn(*args)`` on this thread after the calls before it; its result or error
        comes back through the future. A call that never returns (the engine loop) holds
        the thread until it does."""
        future: Future[T] = Future()

        def call() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on it, never lost here
                future.set_exception(exc)

        self._calls.put(call)
        return future

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``submit`` for asyncio callers: the event loop goes on while the call runs."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Let the thread end after the calls already handed to it (bounded by ``timeout_s``)."""
        self._calls.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            call()
