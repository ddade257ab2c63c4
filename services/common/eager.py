"""Run a coroutine now, on the caller's stack, instead of scheduling a task for it.

``asyncio.create_task`` runs nothing until the loop's next turn: on an idle box
that hop costs the router ~40 µs before a replica request goes out (measured,
docs/router.md). ``run_eagerly`` runs the coroutine up to its first real wait
right away and then on from the done-callbacks of the futures it waits on, as a
task would; Python 3.12's eager task factory does the same, and we run on 3.11.

It is not a Task: it cannot be cancelled or awaited, and it does not appear in
``asyncio.all_tasks()``. The caller learns how it ended through ``on_done``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

OnDone = Callable[[BaseException | None], None]


def run_eagerly(coro: Coroutine[Any, Any, None], on_done: OnDone) -> None:
    """Start ``coro`` now; ``on_done(None)`` once it returns, ``on_done(exc)`` if it raises."""

    def step(_: object = None) -> None:
        try:
            waiting = coro.send(None)
        except StopIteration:
            on_done(None)
            return
        except BaseException as exc:  # whatever it raised is the caller's to judge
            on_done(exc)
            return
        if waiting is None:
            # A bare yield (``asyncio.sleep(0)``): give the loop a turn, then go on.
            asyncio.get_running_loop().call_soon(step)
            return
        if not asyncio.isfuture(waiting):
            # What a Task refuses too ("bad yield"): something that is not an asyncio future.
            coro.close()
            on_done(RuntimeError(f"run_eagerly: the coroutine yielded {waiting!r}, not a future"))
            return
        # The asyncio protocol: a coroutine awaiting a future yields it, flagged as blocking; the
        # awaiting coroutine reads the result itself when resumed (a failure raises inside it).
        waiting._asyncio_future_blocking = False
        waiting.add_done_callback(step)

    step()
