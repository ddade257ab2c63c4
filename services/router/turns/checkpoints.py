"""Turn checkpoints: what a turn settled before its first token, so another router can finish it."""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.gen.llmmesh.v1 import inference_pb2, router_pb2
from services.router.streams.relay import RelayOutcome
from services.router.turns.context import SessionHistory
from services.router.turns.turn_end import TurnState


@dataclass(frozen=True)
class TurnCheckpoint:
    """What a turn decided before its first token, so another router can finish its answer.

    The prompt as built (history and retrieved chunks included), the model that
    answers, the session version the answer will be saved against, and what
    goes into the TurnEnd besides the answer. Resuming with the tokens already
    delivered (``ResumePoint``) continues exactly where the answer stopped:
    the same prompt, the same model, ``resume_token_ids``.
    """

    start: bytes
    model: str
    session_id: str = ""
    session_exists: bool = False
    session_version: int = 0
    citations: tuple[bytes, ...] = ()
    degraded: tuple[str, ...] = ()
    #: The (document id, version) pairs the RAG context came from: a resumed answer's
    #: semantic-cache entry is scoped and invalidated by them, as the first attempt's would be.
    cited: tuple[tuple[str, int], ...] = ()

    def to_json(self) -> str:
        return json.dumps(
            {
                "start": base64.b64encode(self.start).decode(),
                "model": self.model,
                "session_id": self.session_id,
                "session_exists": self.session_exists,
                "session_version": self.session_version,
                "citations": [base64.b64encode(c).decode() for c in self.citations],
                "degraded": list(self.degraded),
                "cited": [[d, v] for d, v in self.cited],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> TurnCheckpoint:
        raw = json.loads(text)
        return cls(
            start=base64.b64decode(raw["start"]),
            model=raw["model"],
            session_id=raw.get("session_id", ""),
            session_exists=bool(raw.get("session_exists", False)),
            session_version=int(raw.get("session_version", 0)),
            citations=tuple(base64.b64decode(c) for c in raw.get("citations", [])),
            degraded=tuple(raw.get("degraded", [])),
            cited=tuple((str(d), int(v)) for d, v in raw.get("cited", [])),
        )


@dataclass(frozen=True)
class ResumePoint:
    """A turn to finish: its checkpoint and the answer delivered so far."""

    checkpoint: TurnCheckpoint
    token_ids: tuple[int, ...]
    text: str


#: Called once per turn, before its first token goes out, with the turn's checkpoint.
OnCheckpoint = Callable[[TurnCheckpoint], Awaitable[None]]
#: Called once the turn's request was admitted against its key's rate (async tasks: a later
#: attempt of the task is not admitted again).
OnAdmitted = Callable[[], Awaitable[None]]
#: Called with the TurnEnd (CANCELLED or ERROR) of a turn that stopped before sending its own.
OnStopped = Callable[[router_pb2.ChatResponse], None]


def checkpoint_of(
    start: inference_pb2.GenerateStart,
    outcome: RelayOutcome,
    request: router_pb2.ChatRequest,
    state: TurnState,
) -> TurnCheckpoint:
    """The checkpoint of a turn about to send its first token."""
    session = state.session
    return TurnCheckpoint(
        start=start.SerializeToString(),
        model=outcome.model,
        session_id=request.session_id if session is not None else "",
        session_exists=session.exists if session is not None else False,
        session_version=session.version if session is not None else 0,
        citations=tuple(c.SerializeToString() for c in state.citations),
        degraded=tuple(state.degraded),
        cited=tuple(state.cited),
    )


def resumed_start(resume: ResumePoint, state: TurnState) -> inference_pb2.GenerateStart:
    """The checkpoint's prompt, and its session version, citations and degradations in ``state``."""
    checkpoint = resume.checkpoint
    start = inference_pb2.GenerateStart.FromString(checkpoint.start)
    start.request_id = state.engine_id
    if checkpoint.session_id:
        state.session = SessionHistory(
            checkpoint.session_id, version=checkpoint.session_version, exists=checkpoint.session_exists
        )
    state.citations = [router_pb2.Citation.FromString(c) for c in checkpoint.citations]
    state.degraded = list(checkpoint.degraded)
    state.cited = list(checkpoint.cited)
    return start
