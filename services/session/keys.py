"""The Redis key layout: a session is keyed by its owner (tenant) and its id.

Each tenant has its own namespace of session ids: the same id in two tenants is two sessions,
each under keys of its own. Until 2026-12-07 a session was keyed by its id alone, so a tenant
that had used an id took it from every other tenant (PERMISSION_DENIED for them, for good), and
which ids other tenants used could be probed (PERMISSION_DENIED vs NOT_FOUND).

A session's keys are ``llm:session:{<id>}:<owner tag>:<part>``. The hash tag holds the id only,
not the owner: every key of one id, whatever its owner and in the old layout
(``llm:session:{<id>}:<part>``, still read: docs/session.md, *Upgrading*), lives in one Redis
Cluster slot, so one Lua script can move a session stored before the change to its owner's
keys atomically, on a single Redis and on a Cluster alike. The price: the same id in many
tenants shares a slot. The owner goes in as a digest, so an owner's characters (any printable
ones, braces and colons included) can neither move the hash tag nor make two keys alike.
"""

from __future__ import annotations

import hashlib

PREFIX = "llm"

#: Hex digits of the owner's SHA-256 in its keys: 128 bits. Scripts still compare the owner
#: stored in the session with the caller, so even a collision would not share a session.
OWNER_TAG_HEX = 32


def owner_tag(owner: str) -> str:
    """The owner's part of its session keys: fixed length, ``[0-9a-f]`` only."""
    return hashlib.sha256(owner.encode("utf-8")).hexdigest()[:OWNER_TAG_HEX]


def _session_key(owner: str, session_id: str, part: str) -> str:
    return f"{PREFIX}:session:{{{session_id}}}:{owner_tag(owner)}:{part}"


def meta_key(owner: str, session_id: str) -> str:
    """Hash: owner, system_prompt, metadata (JSON), version, ttl, created_at_ms, updated_at_ms."""
    return _session_key(owner, session_id, "meta")


def turns_key(owner: str, session_id: str) -> str:
    """List of turns (JSON), oldest first."""
    return _session_key(owner, session_id, "turns")


def requests_key(owner: str, session_id: str) -> str:
    """Hash: each AppendTurns request id the session stored -> "<digest> <first index> <turns>"
    (the digest of its non-assistant turns; where its turns sit in the list).

    At most one entry an append, so bounded by the session's turn limit; expires with the session.
    """
    return _session_key(owner, session_id, "requests")


def legacy_meta_key(session_id: str) -> str:
    """The meta hash of a session stored before sessions were keyed by owner (read, never written)."""
    return f"{PREFIX}:session:{{{session_id}}}:meta"


def legacy_turns_key(session_id: str) -> str:
    """The turns of a session stored before sessions were keyed by owner."""
    return f"{PREFIX}:session:{{{session_id}}}:turns"


def legacy_requests_key(session_id: str) -> str:
    """The request ids of a session stored before sessions were keyed by owner."""
    return f"{PREFIX}:session:{{{session_id}}}:requests"


def script_keys(owner: str, session_id: str) -> list[str]:
    """KEYS of every per-session script (scripts.py): the owner's meta, turns and requests, then
    the same three in the layout from before owners had keys of their own. One slot, all six."""
    return [
        meta_key(owner, session_id),
        turns_key(owner, session_id),
        requests_key(owner, session_id),
        legacy_meta_key(session_id),
        legacy_turns_key(session_id),
        legacy_requests_key(session_id),
    ]


def owner_index_key(owner: str) -> str:
    """Sorted set of an owner's session ids, scored by creation time (ms), for ListSessions.

    Already one per owner before sessions were (its members are ids in the owner's namespace),
    so it is unchanged: the entries of sessions stored in the old layout stay valid.
    """
    return f"{PREFIX}:owner:{{{owner}}}:sessions"
