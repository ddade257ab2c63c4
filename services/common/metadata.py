"""gRPC metadata keys shared across services.

The router authenticates clients and sets the internal keys itself; any value a
client sends for an internal key is stripped at the front door.
"""

from __future__ import annotations

from collections.abc import Iterable

# Set by the router after authentication; read by session and retriever.
TENANT_KEY = "x-llmmesh-tenant"
# The authenticated caller (API key id), for audit and per-user limits.
USER_KEY = "x-llmmesh-user"
# Trailing metadata of an ABORTED AppendTurns: the session's current version.
SESSION_VERSION_KEY = "x-llmmesh-session-version"
# Client API key, as `authorization: Bearer <key>`.
AUTHORIZATION_KEY = "authorization"

INTERNAL_KEYS = frozenset({TENANT_KEY, USER_KEY})


def metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    """The last value of ``key`` in invocation metadata, or None."""
    found: str | None = None
    for k, v in metadata or ():
        if k.lower() == key:
            found = v.decode() if isinstance(v, bytes) else v
    return found
