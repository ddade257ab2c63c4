"""Limits are validated once; request checks name the field a client must fix."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.session import validation
from services.session.limits import SessionLimits
from services.session.model import TurnRecord


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_turns_per_session", 0),
        ("max_turn_bytes", -1),
        ("max_sessions_per_owner", 0),
        ("default_ttl_seconds", 0),
    ],
)
def test_non_positive_limits_are_refused_by_name(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be a positive integer"):
        SessionLimits(**{field: value})  # type: ignore[arg-type]


def test_default_ttl_may_not_exceed_the_maximum() -> None:
    with pytest.raises(ValueError, match="default_ttl_seconds"):
        SessionLimits(default_ttl_seconds=100, max_ttl_seconds=10)


def test_ttl_zero_means_the_default_and_too_long_is_refused() -> None:
    limits = SessionLimits(default_ttl_seconds=3600, max_ttl_seconds=7200)
    assert validation.check_ttl(0, limits) == 3600
    assert validation.check_ttl(7200, limits) == 7200
    with pytest.raises(InvalidArgument, match=r"^ttl_seconds: 7201 exceeds"):
        validation.check_ttl(7201, limits)


@pytest.mark.parametrize("session_id", ["", "a" * 129, "has space", "{tag}", "ü"])
def test_session_ids_outside_the_alphabet_are_refused(session_id: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validation.check_session_id(session_id)
    assert info.value.field == "session_id"


def test_session_ids_inside_the_alphabet_pass() -> None:
    assert validation.check_session_id("user:42.chat_7-b") == "user:42.chat_7-b"


def test_turn_size_counts_utf8_bytes_and_metadata() -> None:
    limits = SessionLimits(max_turn_bytes=10)
    validation.check_turns([TurnRecord("user", "é" * 5)], limits)  # exactly 10 bytes
    with pytest.raises(InvalidArgument, match=r"^turns\[1\]\.content: 11 bytes"):
        validation.check_turns(
            [TurnRecord("user", "ok"), TurnRecord("user", "é" * 5, metadata={"k": ""})], limits
        )


def test_turn_role_count_and_owner_are_checked() -> None:
    limits = SessionLimits(max_turns_per_session=2)
    with pytest.raises(InvalidArgument, match=r"^turns\[0\]\.role"):
        validation.check_turns([TurnRecord("robot", "hi")], limits)
    # A function's result given back after the assistant's call is a turn like the others.
    validation.check_turns(
        [TurnRecord("assistant", '{"name": "f", "arguments": {}}'), TurnRecord("tool", "42")], limits
    )
    with pytest.raises(InvalidArgument, match=r"^turns: 3 turns exceed"):
        validation.check_turns([TurnRecord("user", "x")] * 3, limits)
    with pytest.raises(InvalidArgument, match=r"^x-llmmesh-tenant metadata: is required"):
        validation.check_owner(None)
    with pytest.raises(InvalidArgument, match=r"^page_size"):
        validation.check_page_size(1001)
    assert validation.check_page_size(0) == 100
