"""Checks on what callers send; each failure names the field so a client can fix its request."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.common.errors import InvalidArgument
from services.common.ids import check_client_id
from services.common.ids import check_session_id as check_session_id  # one rule with the router
from services.common.metadata import TENANT_KEY
from services.session.limits import SessionLimits
from services.session.model import ROLES, TurnRecord

MAX_OWNER_CHARS = 256
OWNER_FIELD = f"{TENANT_KEY} metadata"


def check_owner(owner: str | None) -> str:
    """The tenant the router put in the metadata; every call acts for it."""
    if not owner:
        raise InvalidArgument(OWNER_FIELD, "is required (the router sets the caller's tenant)")
    if len(owner) > MAX_OWNER_CHARS or not owner.isprintable():
        raise InvalidArgument(OWNER_FIELD, f"must be 1-{MAX_OWNER_CHARS} printable characters")
    return owner


def metadata_bytes(metadata: Mapping[str, str]) -> int:
    return sum(len(k.encode("utf-8")) + len(v.encode("utf-8")) for k, v in metadata.items())


def check_metadata(field: str, metadata: Mapping[str, str], limits: SessionLimits) -> None:
    if len(metadata) > limits.max_metadata_entries:
        raise InvalidArgument(
            field, f"{len(metadata)} entries exceed the limit of {limits.max_metadata_entries}"
        )


def check_ttl(ttl_seconds: int, limits: SessionLimits) -> int:
    """The TTL to store: the default for 0, else the request's value within bounds."""
    if ttl_seconds == 0:
        return limits.default_ttl_seconds
    if ttl_seconds > limits.max_ttl_seconds:
        raise InvalidArgument(
            "ttl_seconds", f"{ttl_seconds} exceeds the maximum of {limits.max_ttl_seconds} seconds"
        )
    return ttl_seconds


def check_system_prompt(system_prompt: str, metadata: Mapping[str, str], limits: SessionLimits) -> None:
    check_metadata("metadata", metadata, limits)
    size = len(system_prompt.encode("utf-8")) + metadata_bytes(metadata)
    if size > limits.max_turn_bytes:
        raise InvalidArgument(
            "system_prompt", f"{size} bytes (with metadata) exceed the limit of {limits.max_turn_bytes}"
        )


def check_turns(turns: Sequence[TurnRecord], limits: SessionLimits) -> None:
    if not turns:
        raise InvalidArgument("turns", "at least one turn is required")
    if len(turns) > limits.max_turns_per_session:
        raise InvalidArgument(
            "turns", f"{len(turns)} turns exceed the per-session limit of {limits.max_turns_per_session}"
        )
    for i, turn in enumerate(turns):
        if turn.role not in ROLES:
            raise InvalidArgument(
                f"turns[{i}].role", f"must be one of {', '.join(sorted(ROLES))}, got {turn.role[:32]!r}"
            )
        check_metadata(f"turns[{i}].metadata", turn.metadata, limits)
        size = len(turn.content.encode("utf-8")) + metadata_bytes(turn.metadata)
        if size > limits.max_turn_bytes:
            raise InvalidArgument(
                f"turns[{i}].content",
                f"{size} bytes (with metadata) exceed the per-turn limit of {limits.max_turn_bytes}",
            )


def check_request_id(request_id: str, field: str) -> str:
    """An optional request id ("" = none) by the router's rule for its own request ids."""
    return check_client_id(request_id, field) if request_id else ""


def check_page_size(page_size: int) -> int:
    if page_size == 0:
        return 100
    if page_size > 1000:
        raise InvalidArgument("page_size", f"must be 1-1000 (0 means 100), got {page_size}")
    return page_size
