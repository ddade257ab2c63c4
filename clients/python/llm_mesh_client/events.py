"""What a turn's stream yields: deltas of the answer, then its end."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_mesh_client._gen.llmmesh.v1 import common_pb2, router_pb2

FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
    common_pb2.FINISH_REASON_ERROR: "error",
}


@dataclass(frozen=True)
class Delta:
    """More of the answer. ``seq`` numbers the turn's messages from 1 (what `resume()` takes)."""

    text: str
    token_ids: list[int]
    seq: int
    request_id: str


@dataclass(frozen=True)
class End:
    """The turn is over; ``turn`` is the router's TurnEnd (usage, citations, replica, …)."""

    turn: router_pb2.TurnEnd
    seq: int
    request_id: str

    @property
    def finish_reason(self) -> str:
        """ "stop", "length", "cancelled" or "error"."""
        return FINISH_NAMES.get(self.turn.finish_reason, "unspecified")


ChatEvent = Delta | End


@dataclass
class Completion:
    """A whole answer (`complete()`, or a chat stream read to its end)."""

    text: str
    end: router_pb2.TurnEnd
    request_id: str
    token_ids: list[int] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        return FINISH_NAMES.get(self.end.finish_reason, "unspecified")


def event_from(reply: router_pb2.ChatResponse) -> ChatEvent | None:
    if reply.HasField("delta"):
        return Delta(reply.delta.text, list(reply.delta.token_ids), reply.seq, reply.request_id)
    if reply.HasField("end"):
        return End(reply.end, reply.seq, reply.request_id)
    return None
