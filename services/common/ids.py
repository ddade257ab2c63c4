"""The ids clients choose (request ids, task ids): what one may be, checked in one place.

They go into logs, Redis keys, response headers and error messages: a newline would forge a log
line, and a 10 KB id echoed into an error's message made the status itself too large for gRPC's
metadata limit, so the client saw RESOURCE_EXHAUSTED instead of the error.
"""

from __future__ import annotations

import re

from services.common.errors import InvalidArgument

MAX_ID_CHARS = 128
#: A conversation's id. No braces: the session service embeds it in a Redis Cluster hash tag
#: ``{id}``, which a brace would end early.
SESSION_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def check_client_id(value: str, field: str) -> str:
    """``value`` when it is 1-128 printable ASCII characters without spaces; else InvalidArgument."""
    if not value or len(value) > MAX_ID_CHARS or not all("!" <= c <= "~" for c in value):
        shown = value if len(value) <= 40 else value[:40] + "…"
        raise InvalidArgument(
            field, f"must be 1-{MAX_ID_CHARS} printable ASCII characters without spaces, got {shown!r}"
        )
    return value


def check_session_id(value: str, field: str = "session_id") -> str:
    """``value`` when it is a valid session id (``SESSION_ID_RE``); else InvalidArgument.

    The session service checks it on every call; the router checks it too, before any work,
    so a bad id is refused the same way when the session service is down and the turn would
    otherwise go on without history.
    """
    if not SESSION_ID_RE.fullmatch(value):
        shown = value if len(value) <= 40 else value[:40] + "…"
        raise InvalidArgument(field, f"must be 1-128 characters of [A-Za-z0-9_.:-], got {shown!r}")
    return value
