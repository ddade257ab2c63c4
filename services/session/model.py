"""The session service's domain records; the store and the windowing speak these, never protobuf."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: Roles a stored turn may have.
ROLES = frozenset({"user", "assistant", "system", "tool"})


@dataclass(frozen=True)
class TurnRecord:
    """One stored turn of a conversation."""

    role: str
    content: str
    # Tokens in content when the caller knew them; None means "estimate when windowing".
    token_count: int | None = None
    created_at_ms: int = 0
    metadata: Mapping[str, str] = field(default_factory=dict)
    # The AppendTurns request id that stored it ("" when none was given).
    request_id: str = ""


@dataclass(frozen=True)
class NewSession:
    """What CreateSession asks for, validated and with the TTL resolved."""

    session_id: str
    owner: str
    system_prompt: str
    metadata: Mapping[str, str]
    ttl_seconds: int


@dataclass(frozen=True)
class SessionHeader:
    """A session's header as stored, plus its turn count."""

    session_id: str
    owner: str
    system_prompt: str
    metadata: Mapping[str, str]
    version: int
    turn_count: int
    ttl_seconds: int
    created_at_ms: int
    updated_at_ms: int


@dataclass(frozen=True)
class SessionWindow:
    """A session's header and the newest turns a window kept (oldest first)."""

    header: SessionHeader
    turns: tuple[TurnRecord, ...]
    omitted_turns: int


@dataclass(frozen=True)
class SessionPage:
    """One page of an owner's sessions and the token for the next ("" on the last)."""

    sessions: tuple[SessionHeader, ...]
    next_page_token: str


def request_digest(turns: Sequence[TurnRecord]) -> str:
    """What tells a retry of a request from another request under its id: its non-assistant turns.

    A retry's answer may differ (sampling), its question does not.
    """
    asked = [[t.role, t.content] for t in turns if t.role != "assistant"]
    return hashlib.sha256(json.dumps(asked, ensure_ascii=False).encode()).hexdigest()
