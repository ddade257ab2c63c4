"""The ids clients choose (request ids, task ids): what one may be, checked in one place.

They go into logs, Redis keys, response headers and error messages: a newline would forge a log
line, and a 10 KB id echoed into an error's message made the status itself too large for gRPC's
metadata limit, so the client saw RESOURCE_EXHAUSTED instead of the error.
"""

from __future__ import annotations

from services.common.errors import InvalidArgument

MAX_ID_CHARS = 128


def check_client_id(value: str, field: str) -> str:
    """``value`` when it is 1-128 printable ASCII characters without spaces; else InvalidArgument."""
    if not value or len(value) > MAX_ID_CHARS or not all("!" <= c <= "~" for c in value):
        shown = value if len(value) <= 40 else value[:40] + "…"
        raise InvalidArgument(
            field, f"must be 1-{MAX_ID_CHARS} printable ASCII characters without spaces, got {shown!r}"
        )
    return value
