"""Undecodable requests become INVALID_ARGUMENT naming the field with bad UTF-8."""

from __future__ import annotations

import pytest

from services.gen.llmmesh.v1 import session_pb2 as pb
from services.session.wire import UndecodableRequest, tolerant_deserializer


def corrupt(message: pb.AppendTurnsRequest | pb.CreateSessionRequest, marker: bytes) -> bytes:
    data = message.SerializeToString()
    assert data.count(marker) == 1
    return data.replace(marker, b"\xc3\x28")  # an invalid two-byte UTF-8 sequence


@pytest.mark.parametrize(
    ("message", "marker", "path"),
    [
        (
            pb.AppendTurnsRequest(
                session_id="s", turns=[pb.Turn(role="user", content="ok"), pb.Turn(role="user", content="QQ")]
            ),
            b"QQ",
            "turns[1].content",
        ),
        (
            pb.AppendTurnsRequest(
                session_id="s", turns=[pb.Turn(role="user", content="ok", metadata={"k": "QQ"})]
            ),
            b"QQ",
            "turns[0].metadata.value",
        ),
        (pb.CreateSessionRequest(session_id="s", system_prompt="QQ"), b"QQ", "system_prompt"),
    ],
)
def test_bad_utf8_is_reported_with_its_field_path(
    message: pb.AppendTurnsRequest | pb.CreateSessionRequest, marker: bytes, path: str
) -> None:
    decoded = tolerant_deserializer(type(message))(corrupt(message, marker))
    assert isinstance(decoded, UndecodableRequest)
    assert str(decoded.error) == f"{path}: is not valid UTF-8"


def test_valid_requests_decode_unchanged_and_garbage_is_named_as_such() -> None:
    request = pb.AppendTurnsRequest(
        session_id="s", turns=[pb.Turn(role="user", content="héllo")], expected_version=3
    )
    assert tolerant_deserializer(pb.AppendTurnsRequest)(request.SerializeToString()) == request
    garbage = tolerant_deserializer(pb.AppendTurnsRequest)(b"\xff\xff\xff")
    assert isinstance(garbage, UndecodableRequest) and garbage.error.field == "request"
