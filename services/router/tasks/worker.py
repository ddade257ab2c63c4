"""The task worker: takes tasks from the shared queue, runs their turns, and records how they ended.

Every router runs a worker in the consumer group, so any router may run any
task; a task survives the router that accepted it, or ran it, being killed:
its entry stays pending until acknowledged, and another router takes it over
(continuing the answer from its checkpoint where tokens were delivered).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import AsyncGenerator
from typing import Protocol

import grpc

from services.common import errors
from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.admission.auth import Principal
from services.router.tasks.counters import TASKS_FINISHED, TASKS_RECLAIMED, TASKS_RESUMED, TASKS_RUNNING
from services.router.tasks.record import TaskRecord
from services.router.tasks.settings import TaskSettings
from services.router.tasks.store import SUPERSEDED, Superseded, TaskStore
from services.router.turns.checkpoints import OnAdmitted, OnCheckpoint, OnStopped, ResumePoint, TurnCheckpoint

log = logging.getLogger("llmmesh.router.tasks")

#: The longest wait between two tries of the task loop while Redis does not answer.
OUTAGE_RETRY_MAX_S = 5.0
QUEUED_OR_RUNNING = frozenset({router_pb2.TASK_STATE_QUEUED, router_pb2.TASK_STATE_RUNNING})


class RunTurn(Protocol):
    """``TurnPipeline.run_turn`` as the task worker calls it."""

    def __call__(
        self,
        principal: Principal,
        request: router_pb2.ChatRequest,
        deadline: float | None = None,
        *,
        resume: ResumePoint | None = None,
        on_checkpoint: OnCheckpoint | None = None,
        on_stopped: OnStopped | None = None,
        replayable: bool = True,
        admitted: bool = False,
        on_admitted: OnAdmitted | None = None,
    ) -> AsyncGenerator[router_pb2.ChatResponse, None]: ...


class Redeliver(Exception):
    """The turn could not start (no replica reachable, before any token): run the task again later."""


def default_consumer_name() -> str:
    """Unique per process: a restarted router must not inherit the dead one's pending entries by name."""
    return f"{socket.gethostname()}-{os.getpid()}"


class TaskWorker:
    """Runs up to ``settings.concurrency`` tasks at once from the queue, as consumer ``consumer``."""

    def __init__(
        self, store: TaskStore, run_turn: RunTurn, consumer: str | None, settings: TaskSettings
    ) -> None:
        self.store = store
        self.run_turn = run_turn
        self.consumer = consumer or default_consumer_name()
        self.settings = settings
        self._worker: asyncio.Task[None] | None = None
        self._running: dict[str, asyncio.Task[None]] = {}  # entry id -> task run
        self._task_ids: dict[str, str] = {}  # entry id -> task id, for the heartbeat
        # Entries the heartbeat found another router running (this one was paused past the
        # visibility timeout): their runs here are cancelled and write nothing more.
        self._taken_over: set[str] = set()
        self._stopping = False

    async def start(self) -> None:
        await self.store.ensure_group()
        self._stopping = False
        self._worker = asyncio.create_task(self._work(), name=f"task-worker-{self.consumer}")

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking tasks; let running ones finish for ``grace_s``, then leave the rest to other routers."""
        self._stopping = True
        if self._worker is not None:
            # The loop notices the flag when its blocking read returns; cancel only if it does not.
            done, _ = await asyncio.wait({self._worker}, timeout=self.settings.block_ms / 1000 + 2.0)
            if not done:
                self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None
        if self._running:
            await asyncio.wait(list(self._running.values()), timeout=grace_s)
        runs = list(self._running.values())
        while runs:
            for run in runs:
                run.cancel()  # handed back (or left unacknowledged): another router takes it
            # Cancelled again until it ends: a cancellation that lands inside a Redis client's
            # own timeout handling can be swallowed (redis-py's async timeouts), and the run then
            # went on to its end, holding a rolling restart for the whole answer (40 s, measured).
            await asyncio.wait(runs, timeout=1.0)
            runs = [run for run in runs if not run.done()]
        for run in list(self._running.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await run

    @staticmethod
    def _answered(failures: int) -> int:
        """Redis answered a whole pass: an outage the worker had said is over (it says so)."""
        if failures:
            log.info("task worker: Redis answers again after %d failed tries", failures)
        return 0

    async def _work(self) -> None:
        failures = 0  # passes that failed in a row (Redis away)
        loop = asyncio.get_running_loop()
        next_reclaim = 0.0
        next_heartbeat = loop.time() + self.settings.visibility_timeout_s / 3
        while not self._stopping:
            try:
                now = loop.time()
                if now >= next_heartbeat:
                    running = [(e, self._task_ids[e]) for e in self._running if e in self._task_ids]
                    for entry_id in await self.store.heartbeat(self.consumer, running):
                        self._stand_down(entry_id)
                    next_heartbeat = now + self.settings.visibility_timeout_s / 3
                free = self.settings.concurrency - len(self._running)
                if free > 0 and now >= next_reclaim:
                    min_idle = int(self.settings.visibility_timeout_s * 1000)
                    for entry_id, task_id in await self.store.reclaim(self.consumer, min_idle, free):
                        if entry_id in self._running:
                            continue  # its own run, idle because a heartbeat failed: claimed again now
                        TASKS_RECLAIMED.inc()
                        log.warning("took over task %s left unacknowledged by another router", task_id)
                        self._launch(entry_id, task_id)
                    next_reclaim = now + min(5.0, self.settings.visibility_timeout_s / 2)
                    free = self.settings.concurrency - len(self._running)
                if free <= 0:
                    failures = self._answered(failures)
                    await asyncio.wait(
                        list(self._running.values()), timeout=1.0, return_when=asyncio.FIRST_COMPLETED
                    )
                    continue
                block = min(self.settings.block_ms, int(self.settings.visibility_timeout_s * 1000 / 3))
                for entry_id, task_id in await self.store.take_new(self.consumer, free, block):
                    if self._stopping:
                        break  # left pending: reclaimed by another router once idle
                    self._launch(entry_id, task_id)
                failures = self._answered(failures)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: keep the loop alive and try again shortly
                # Said once an outage (a WARNING a second per router flooded the logs while
                # Redis was down), then tried again ever less often, up to every 5 s.
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "task worker: %s: %s (retrying until Redis answers)", type(exc).__name__, exc)
                await asyncio.sleep(min(OUTAGE_RETRY_MAX_S, 0.5 * 2 ** min(failures - 1, 8)))

    def _stand_down(self, entry_id: str) -> None:
        """Another router took this entry's task over: this run stops, writing nothing more."""
        run = self._running.get(entry_id)
        if run is None:
            return
        log.warning(
            "task %s was taken over by another router: its run here stops", self._task_ids.get(entry_id)
        )
        self._taken_over.add(entry_id)
        run.cancel()

    def _launch(self, entry_id: str, task_id: str) -> None:
        run = asyncio.create_task(self._run_task(entry_id, task_id), name=f"task-{task_id}")
        self._running[entry_id] = run
        self._task_ids[entry_id] = task_id
        TASKS_RUNNING.set(len(self._running))

        def done(finished: asyncio.Task[None]) -> None:
            self._running.pop(entry_id, None)
            self._task_ids.pop(entry_id, None)
            self._taken_over.discard(entry_id)
            TASKS_RUNNING.set(len(self._running))
            if not finished.cancelled() and (exc := finished.exception()) is not None:
                # Most likely Redis went away mid-task: the entry stays pending and is retried.
                log.warning("task %s interrupted, left for a retry: %s: %s", task_id, type(exc).__name__, exc)

        run.add_done_callback(done)

    async def _run_task(self, entry_id: str, task_id: str) -> None:
        record = await self.store.get(task_id, with_resume_state=True)
        if record is None or record.finished:
            await self.store.ack(entry_id)
            return
        if record.cancel_requested:
            await self._finish(record, router_pb2.TASK_STATE_CANCELLED, error="cancelled by the client")
            await self.store.ack(entry_id)
            return
        if record.attempts >= self.settings.max_attempts:
            await self._finish(
                record,
                router_pb2.TASK_STATE_FAILED,
                error=f"gave up after {record.attempts} interrupted attempts",
            )
            await self.store.ack(entry_id)
            return
        # An attempt that delivered tokens after saving its checkpoint is continued after them;
        # any other starts again from nothing (its text and token ids are cleared).
        resume = _resume_point(record)
        # This run's token: every write checks it, so a run that lost the task writes nothing.
        run = f"{self.consumer}/{record.attempts + 1}/{uuid.uuid4().hex[:8]}"
        _, changed = await self.store.transition(
            record,
            QUEUED_OR_RUNNING,
            router_pb2.TASK_STATE_RUNNING,
            reset_text=resume is None,
            extra={"attempts": record.attempts + 1, "run": run},
        )
        if not changed:  # cancelled between the read and now
            await self.store.ack(entry_id)
            return
        record.attempts += 1
        record.run = run
        if resume is None:
            record.checkpoint, record.token_ids = "", ()
        else:
            TASKS_RESUMED.inc()
            log.info("task %s continues after %d tokens", record.task_id, len(resume.token_ids))
        try:
            final_state, end, error = await self._generate(record, resume)
        except Redeliver as exc:
            # Left unacknowledged: once idle past the visibility timeout, a router (maybe this
            # one) reclaims it; that wait is the back-off while the replicas come back.
            log.warning(
                "task %s goes back to the queue (attempt %d): %s", record.task_id, record.attempts, exc
            )
            await self.store.transition(
                record, {router_pb2.TASK_STATE_RUNNING}, router_pb2.TASK_STATE_QUEUED, run=record.run
            )
            return
        except Superseded:
            log.warning("task %s was taken over by another router: its run here stops", record.task_id)
            return  # the entry is the other router's now: no finish, no acknowledgement
        except asyncio.CancelledError:
            if entry_id in self._taken_over:
                return
            if self._stopping:
                # Handed back for another router to start at once, the attempt not counted.
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.store.hand_back(entry_id, record))
                raise
            final_state, end, error = router_pb2.TASK_STATE_CANCELLED, b"", "cancelled by the client"
        if await self._finish(record, final_state, end=end, error=error) != SUPERSEDED:
            await self.store.ack(entry_id)

    async def _generate(self, record: TaskRecord, resume: ResumePoint | None) -> tuple[int, bytes, str]:
        """Run the turn; while the key is over its rate limit, wait and try again instead of failing.

        A task is the asynchronous form of a turn: the client asked for it to
        happen, not to happen now, so a refusal before the first token waits
        out the RetryInfo delay (up to ``overload_wait_s`` in all).
        """
        waited = 0.0
        while True:
            try:
                return await self._generate_once(record, resume)
            except errors.Overloaded as exc:
                if waited >= self.settings.overload_wait_s:
                    return router_pb2.TASK_STATE_FAILED, b"", f"RESOURCE_EXHAUSTED: {exc}"
                pause = min(max(exc.retry_after_s, 0.05), 30.0, self.settings.overload_wait_s - waited)
                log.info("task %s waits %.2fs: %s", record.task_id, pause, exc)
                if await self._cancelled_within(record.task_id, pause):
                    return router_pb2.TASK_STATE_CANCELLED, b"", "cancelled by the client"
                waited += pause

    async def _cancelled_within(self, task_id: str, seconds: float) -> bool:
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        while (left := until - loop.time()) > 0:
            if await self.store.cancel_requested(task_id):
                return True
            await asyncio.sleep(min(0.25, left))
        return False

    async def _generate_once(self, record: TaskRecord, resume: ResumePoint | None) -> tuple[int, bytes, str]:
        """Run the turn, streaming deltas into the task; a cancel request stops it mid-way."""
        request = router_pb2.ChatRequest.FromString(record.request)
        end: router_pb2.TurnEnd | None = None
        streamed = False

        async def save_checkpoint(checkpoint: TurnCheckpoint) -> None:
            record.checkpoint = checkpoint.to_json()
            await self.store.save_checkpoint(record.task_id, record.checkpoint, record.run)

        async def mark_admitted() -> None:
            # Before the key's request is spent again by a later attempt (a takeover, a
            # redelivery, a retry while the replicas are busy), the task says it was admitted.
            record.admitted = True
            await self.store.mark_admitted(record.task_id, record.run)

        def stopped(response: router_pb2.ChatResponse) -> None:
            # A cancelled turn's end: the tokens the task streamed, and the replica that made them.
            nonlocal end
            end = response.end

        async def consume() -> None:
            nonlocal end, streamed
            turn = self.run_turn(
                record.principal,
                request,
                resume=resume,
                on_checkpoint=save_checkpoint,
                on_stopped=stopped,
                replayable=False,  # a task's answer is read from the task (WatchTask), not Resume
                admitted=record.admitted,
                on_admitted=mark_admitted,
            )
            # Closed at once on a cancel (not when collected), so its end is known before the task's.
            async with contextlib.aclosing(turn):
                async for response in turn:
                    if response.HasField("delta"):
                        streamed = True
                        record.text += response.delta.text
                        await self._append(record, response.delta)
                    elif response.HasField("end"):
                        end = response.end

        generation = asyncio.create_task(consume())
        try:
            while not generation.done():
                done, _ = await asyncio.wait({generation}, timeout=0.25)
                if not done and await self.store.cancel_requested(record.task_id):
                    generation.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await generation
                    return router_pb2.TASK_STATE_CANCELLED, _end_bytes(end), "cancelled by the client"
            generation.result()
        except errors.MeshError as exc:
            if isinstance(exc, errors.Overloaded) and not streamed:
                raise  # refused before the first token: _generate waits and retries
            message = f"{exc.code.name}: {exc}"
            if exc.code == errors.Code.UNAVAILABLE and self._may_redeliver(record):
                raise Redeliver(message) from exc
            return router_pb2.TASK_STATE_FAILED, b"", message
        except grpc.aio.AioRpcError as exc:
            message = f"{exc.code().name}: {exc.details()}"
            if exc.code() == grpc.StatusCode.UNAVAILABLE and self._may_redeliver(record):
                raise Redeliver(message) from exc
            return router_pb2.TASK_STATE_FAILED, b"", message
        except ValueError as exc:
            return router_pb2.TASK_STATE_FAILED, b"", f"INVALID_ARGUMENT: {exc}"
        finally:
            if not generation.done():
                generation.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await generation
        if end is None:
            return router_pb2.TASK_STATE_FAILED, b"", "the turn ended without a turn-end message"
        if end.finish_reason == common_pb2.FINISH_REASON_ERROR:
            return router_pb2.TASK_STATE_FAILED, _end_bytes(end), end.error_message or "generation failed"
        if end.finish_reason == common_pb2.FINISH_REASON_CANCELLED:
            return router_pb2.TASK_STATE_CANCELLED, _end_bytes(end), "cancelled"
        return router_pb2.TASK_STATE_SUCCEEDED, _end_bytes(end), ""

    async def _append(self, record: TaskRecord, delta: router_pb2.TokenDelta) -> None:
        """Store a delta whole even when the task is cancelled meanwhile: the turn counts it as
        streamed (it left the pipeline), so the task's text and events must hold it too."""
        write = asyncio.ensure_future(self.store.append_delta(record.task_id, delta, record.run))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await write
            raise

    def _may_redeliver(self, record: TaskRecord) -> bool:
        """Nothing streamed yet and runs left: failing now would only report a passing outage."""
        return not record.text and record.attempts < self.settings.max_attempts

    async def _finish(self, record: TaskRecord, state: int, *, end: bytes = b"", error: str = "") -> int:
        """The task's end, if this run still owns it; returns the state now (``SUPERSEDED``: not)."""
        now, changed = await self.store.transition(
            record, QUEUED_OR_RUNNING, state, end=end, error=error, run=record.run
        )
        if changed:
            TASKS_FINISHED.labels(router_pb2.TaskState.Name(state).removeprefix("TASK_STATE_")).inc()  # type: ignore[arg-type]
        return now


def _resume_point(record: TaskRecord) -> ResumePoint | None:
    """Where a task's earlier attempt left its answer, when it can be continued exactly."""
    if not record.checkpoint or not record.token_ids:
        return None
    try:
        checkpoint = TurnCheckpoint.from_json(record.checkpoint)
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("task %s: unreadable checkpoint, its answer starts again: %r", record.task_id, exc)
        return None
    return ResumePoint(checkpoint, record.token_ids, record.text)


def _end_bytes(end: router_pb2.TurnEnd | None) -> bytes:
    return b"" if end is None else end.SerializeToString()
