"""The async-task RPCs: SubmitTask, GetTask, WatchTask, CancelTask, for an authenticated tenant.

Tasks are stored in Redis (``tasks/store.py``) and run by every router's worker
(``tasks/worker.py``), so a task outlives the router that accepted it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from services.common import errors
from services.common.ids import check_client_id
from services.gen.llmmesh.v1 import router_pb2
from services.router.admission.auth import Principal
from services.router.tasks.counters import TASKS_FINISHED, TASKS_REFUSED
from services.router.tasks.keys import KIND_TASK, TaskKeys
from services.router.tasks.record import TERMINAL_STATES, TaskRecord
from services.router.tasks.settings import TaskSettings
from services.router.tasks.store import TaskRefused, TaskStore
from services.router.tasks.worker import RunTurn, TaskWorker
from services.router.turns.validation import validate

MAX_IDEMPOTENCY_KEY = 256

#: Raises the turn's own refusal (INVALID_ARGUMENT naming ``model``) for a model name no known
#: replica could ever serve; returns quietly when nothing is known yet (a task outlives an outage).
CheckModel = Callable[[str], None]


class TaskApi:
    """Serves the task RPCs for an authenticated principal; starts and stops the task worker."""

    def __init__(
        self,
        redis: Any,
        run_turn: RunTurn,
        consumer_name: str | None = None,
        settings: TaskSettings | None = None,
        keys: TaskKeys | None = None,
        check_model: CheckModel | None = None,
    ) -> None:
        self.settings = settings or TaskSettings.from_env()
        self.check_model = check_model
        self.store = TaskStore(
            redis,
            result_ttl_s=self.settings.result_ttl_s,
            max_open_per_tenant=self.settings.max_per_tenant,
            max_open_bytes_per_tenant=self.settings.max_bytes_per_tenant,
            max_queued=self.settings.max_queued,
            keys=keys,
        )
        self.worker = TaskWorker(self.store, run_turn, consumer_name, self.settings)

    # --- RPCs -------------------------------------------------------------------------

    async def SubmitTask(
        self,
        principal: Principal,
        request: router_pb2.SubmitTaskRequest,
        context: grpc.aio.ServicerContext[Any, Any] | None = None,
    ) -> router_pb2.Task:
        turn = request.request
        if turn.cancel:
            raise errors.InvalidArgument("request.cancel", "a task is a turn to run, not a cancel")
        # Refused now, not accepted and failed later: the same checks the turn itself makes.
        validate(turn, field_prefix="request.")
        if self.check_model is not None:
            # A misspelt model would otherwise be accepted, queued, and fail only when a worker
            # ran it; the refusal names ``request.model`` as the turn's own would name ``model``.
            try:
                self.check_model(turn.model)
            except errors.InvalidArgument as exc:
                problem = str(exc).removeprefix(f"{exc.field}: ")
                raise errors.InvalidArgument("request.model", problem) from None
        if len(request.idempotency_key) > MAX_IDEMPOTENCY_KEY:
            raise errors.InvalidArgument("idempotency_key", f"at most {MAX_IDEMPOTENCY_KEY} characters")
        task_id = _new_task_id()
        if not turn.request_id:
            turn = router_pb2.ChatRequest()
            turn.CopyFrom(request.request)
            turn.request_id = f"task-{task_id}"
        try:
            # The key is claimed in the same step that creates the task (nothing is stored when
            # refused, so the same key may be submitted again once there is room).
            record = await self.store.create(principal, turn, task_id, request.idempotency_key)
        except TaskRefused as exc:
            TASKS_REFUSED.labels(exc.reason).inc()
            raise
        if isinstance(record, str):  # submitted before under this key: that task
            return await self.GetTask(principal, router_pb2.GetTaskRequest(task_id=record), context)
        return record.to_proto()

    async def GetTask(
        self,
        principal: Principal,
        request: router_pb2.GetTaskRequest,
        context: grpc.aio.ServicerContext[Any, Any] | None = None,
    ) -> router_pb2.Task:
        return (await self._owned(principal, request.task_id)).to_proto()

    async def WatchTask(
        self,
        principal: Principal,
        request: router_pb2.WatchTaskRequest,
        context: grpc.aio.ServicerContext[Any, Any] | None = None,
    ) -> AsyncIterator[router_pb2.TaskEvent]:
        """The task now, then every delta and state change until it ends."""
        await self._owned(principal, request.task_id)
        record, cursor = await self.store.snapshot(request.task_id)
        if record is None:
            raise errors.NotFound(f"task_id: no task {request.task_id!r} (unknown or expired)")
        yield router_pb2.TaskEvent(task=record.to_proto())
        if record.finished:
            return
        while True:
            events = await self.store.read_events(request.task_id, cursor, self.settings.block_ms)
            if not events and not await self.store.exists(request.task_id):
                raise errors.NotFound(f"task_id: task {request.task_id!r} expired while watched")
            for event_id, kind, payload in events:
                cursor = event_id
                if kind == KIND_TASK:
                    task = router_pb2.Task.FromString(payload)
                    yield router_pb2.TaskEvent(task=task)
                    if task.state in TERMINAL_STATES:
                        return
                else:
                    yield router_pb2.TaskEvent(delta=router_pb2.TokenDelta.FromString(payload))

    async def CancelTask(
        self,
        principal: Principal,
        request: router_pb2.CancelTaskRequest,
        context: grpc.aio.ServicerContext[Any, Any] | None = None,
    ) -> router_pb2.Task:
        """Cancels a queued task at once; a running one within moments (its worker stops the replica)."""
        record = await self._owned(principal, request.task_id)
        if record.finished:
            return record.to_proto()
        await self.store.request_cancel(record.task_id)
        state, _ = await self.store.transition(
            record,
            {router_pb2.TASK_STATE_QUEUED},
            router_pb2.TASK_STATE_CANCELLED,
            error="cancelled by the client",
        )
        if state == router_pb2.TASK_STATE_CANCELLED:
            TASKS_FINISHED.labels("CANCELLED").inc()
        # A running task stops at its worker's next cancel check; wait briefly to report the end.
        for _ in range(20):
            record = await self._owned(principal, request.task_id)
            if record.finished:
                break
            await asyncio.sleep(0.1)
        return record.to_proto()

    async def _owned(self, principal: Principal, task_id: str) -> TaskRecord:
        record = await self.store.get(check_client_id(task_id, "task_id"))
        if record is None:
            raise errors.NotFound(f"task_id: no task {task_id!r} (unknown or expired)")
        if record.tenant != principal.tenant:
            raise errors.PermissionDenied(f"task_id: task {task_id!r} belongs to another tenant")
        return record

    async def start(self) -> None:
        """Join the consumer group and start taking tasks."""
        await self.worker.start()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking tasks; let running ones finish for ``grace_s``, then leave the rest to other routers."""
        await self.worker.stop(grace_s)


def _new_task_id() -> str:
    return uuid.uuid4().hex
