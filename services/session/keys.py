"""The Redis key layout; the `{…}` hash tags put all of one session's keys in one cluster slot."""

from __future__ import annotations

PREFIX = "llm"


def meta_key(session_id: str) -> str:
    """Hash: owner, system_prompt, metadata (JSON), version, ttl, created_at_ms, updated_at_ms."""
    return f"{PREFIX}:session:{{{session_id}}}:meta"


def turns_key(session_id: str) -> str:
    """List of turns (JSON), oldest first."""
    return f"{PREFIX}:session:{{{session_id}}}:turns"


def requests_key(session_id: str) -> str:
    """Hash: each AppendTurns request id the session stored -> "<digest> <first index> <turns>"
    (the digest of its non-assistant turns; where its turns sit in the list).

    At most one entry an append, so bounded by the session's turn limit; expires with the session.
    """
    return f"{PREFIX}:session:{{{session_id}}}:requests"


def owner_index_key(owner: str) -> str:
    """Sorted set of an owner's session ids, scored by creation time (ms), for ListSessions."""
    return f"{PREFIX}:owner:{{{owner}}}:sessions"
