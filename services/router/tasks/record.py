"""A task as stored: the record, how it reads from its hash, and the token ids packed beside it."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

from services.gen.llmmesh.v1 import router_pb2
from services.router.admission.auth import KeyLimits, Principal

TERMINAL_STATES = frozenset(
    {router_pb2.TASK_STATE_SUCCEEDED, router_pb2.TASK_STATE_FAILED, router_pb2.TASK_STATE_CANCELLED}
)


def pack_token_ids(token_ids: Iterable[int]) -> bytes:
    ids = list(token_ids)
    return struct.pack(f"<{len(ids)}i", *ids)


def unpack_token_ids(raw: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(raw) // 4}i", raw[: len(raw) - len(raw) % 4])


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class TaskRecord:
    """A task as stored in its hash (plus its text)."""

    task_id: str
    state: int
    tenant: str
    key_id: str
    limits: KeyLimits
    request: bytes
    text: str = ""
    end: bytes = b""
    error: str = ""
    created_ms: int = 0
    updated_ms: int = 0
    attempts: int = 0
    cancel_requested: bool = False
    result_ttl_s: int = 600
    #: ``TurnCheckpoint.to_json()`` of the running attempt, once its first token was out (read,
    #: with ``request`` and ``token_ids``, only when asked: ``TaskStore.get(with_resume_state=True)``).
    checkpoint: str = ""
    #: The answer's token ids so far (read only when asked: ``TaskStore.get(with_resume_state=True)``).
    token_ids: tuple[int, ...] = ()
    #: An attempt's turn was admitted against the key's request rate: later attempts are not.
    admitted: bool = False
    #: The run that owns the task (set when it moves to RUNNING); every write of a run checks it.
    run: str = ""

    @property
    def principal(self) -> Principal:
        return Principal(self.tenant, self.key_id, self.limits)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    def to_proto(self) -> router_pb2.Task:
        task = router_pb2.Task(
            task_id=self.task_id,
            state=self.state,  # type: ignore[arg-type]
            text=self.text,
            error_message=self.error,
            created_at_ms=self.created_ms,
            updated_at_ms=self.updated_ms,
            result_ttl_seconds=self.result_ttl_s,
        )
        if self.end:
            task.end.ParseFromString(self.end)
        return task

    @classmethod
    def from_hash(
        cls,
        task_id: str,
        raw: dict[bytes, bytes],
        text: bytes | None,
        result_ttl_s: int,
        tokens: bytes | None = None,
    ) -> TaskRecord:
        def s(name: str) -> str:
            return raw.get(name.encode(), b"").decode()

        limits = json.loads(s("limits") or "{}")
        return cls(
            task_id=task_id,
            state=int(s("state") or 0),
            tenant=s("tenant"),
            key_id=s("key_id"),
            limits=KeyLimits(**limits),
            request=raw.get(b"request", b""),
            text=(text or b"").decode(errors="replace"),
            end=raw.get(b"end", b""),
            error=s("error"),
            created_ms=int(s("created_ms") or 0),
            updated_ms=int(s("updated_ms") or 0),
            attempts=int(s("attempts") or 0),
            cancel_requested=s("cancel") == "1",
            result_ttl_s=result_ttl_s,
            checkpoint=s("checkpoint"),
            token_ids=unpack_token_ids(tokens or b""),
            admitted=s("admitted") == "1",
            run=s("run"),
        )


#: The hash fields a client's view of a task needs: all but the ``request`` (the messages as
#: submitted) and the running attempt's ``checkpoint`` (its whole prompt, history and RAG
#: context included), which only the worker running or taking over the task reads.
STATUS_FIELDS = (
    "state",
    "tenant",
    "key_id",
    "limits",
    "end",
    "error",
    "created_ms",
    "updated_ms",
    "attempts",
    "cancel",
)


_STATUS_KEYS = tuple(name.encode() for name in STATUS_FIELDS)


def status_hash(values: list[bytes | None]) -> dict[bytes, bytes]:
    """HMGET of ``STATUS_FIELDS`` as the hash it reads; empty when the task does not exist."""
    return {key: v for key, v in zip(_STATUS_KEYS, values, strict=True) if v is not None}
