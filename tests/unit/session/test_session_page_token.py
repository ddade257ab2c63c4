"""ListSessions cursors: round-trip, and anything else is INVALID_ARGUMENT naming page_token."""

from __future__ import annotations

import base64

import pytest

from services.common.errors import InvalidArgument
from services.session.store import decode_page_token, encode_page_token


def test_a_cursor_round_trips_to_whole_milliseconds_and_the_id() -> None:
    assert decode_page_token(encode_page_token("1795981446293", "chat:1|x")) == ("1795981446293", "chat:1|x")
    assert decode_page_token(encode_page_token("1.5e3", "s")) == ("1500", "s")


@pytest.mark.parametrize(
    "token",
    [
        "not-a-token",
        base64.urlsafe_b64encode(b"nan|s").decode(),
        base64.urlsafe_b64encode(b"12").decode(),
        "%%%",
        # Digits str.isdigit takes and Redis does not: they reached the page script (INTERNAL).
        base64.urlsafe_b64encode("²|s".encode()).decode(),
        base64.urlsafe_b64encode("١٢|s".encode()).decode(),
    ],
)
def test_forged_or_garbled_tokens_are_refused(token: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        decode_page_token(token)
    assert info.value.field == "page_token"
