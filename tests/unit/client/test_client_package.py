"""The client package's request building and errors, without a router (llm_mesh_client)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from llm_mesh_client import InvalidArgument, MeshError, NotFound, Unavailable
from llm_mesh_client.errors import error_from_rpc
from llm_mesh_client.pb import router_pb2
from llm_mesh_client.requests import PIECE_BYTES, chat_request, document_source


class FailedCall(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """What grpc raises for a failed call: a code and the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.DATA_LOSS, MeshError),
    ],
)
def test_a_failed_call_becomes_the_error_named_after_its_code_with_the_message(
    code: grpc.StatusCode, cls: type[MeshError]
) -> None:
    error = error_from_rpc(FailedCall(code, "sampling.temperature must be >= 0"))
    assert type(error) is cls
    assert (error.code, error.message) == (code, "sampling.temperature must be >= 0")
    assert str(error) == f"{code.name}: sampling.temperature must be >= 0"


def test_prompts_become_messages_and_options_fill_only_what_they_set() -> None:
    request = chat_request([("system", "Be brief."), ("user", "Hi")], max_tokens=5, temperature=0.0)
    assert [(m.role, m.content) for m in request.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert not request.sampling.HasField("top_p")
    given = router_pb2.ChatRequest(session_id="s1", model="m")
    built = chat_request(given, max_tokens=3, session_must_exist=True)
    assert (built.session_id, built.model, built.sampling.max_tokens, built.session_must_exist) == (
        "s1",
        "m",
        3,
        True,
    )
    assert not given.HasField("sampling")  # the caller's request is left as it was


def test_a_document_is_sent_as_a_header_then_pieces_and_bytes_need_an_id_and_a_type(tmp_path: Path) -> None:
    path = tmp_path / "notes.md"
    path.write_bytes(b"x" * (PIECE_BYTES + 10))
    pieces = list(document_source(path, metadata={"team": "a"}).pieces())
    assert pieces[0].header.document_id == "notes.md" and pieces[0].header.title == "notes"
    assert dict(pieces[0].header.metadata) == {"team": "a"}
    assert [len(p.data) for p in pieces[1:]] == [PIECE_BYTES, 10]
    with pytest.raises(ValueError, match="document_id"):
        document_source(b"text", filename="a.txt")
    with pytest.raises(ValueError, match="mime_type or a filename"):
        document_source(b"text", document_id="a")
    with pytest.raises(FileNotFoundError, match="no such file"):
        document_source(tmp_path / "missing.pdf")
