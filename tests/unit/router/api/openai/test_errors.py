"""The one table from the mesh's errors to OpenAI-shaped HTTP errors."""

from __future__ import annotations

import logging

import grpc
import pytest

from services.common import errors
from services.router.api.openai.errors import MAX_MESSAGE_CHARS, api_error, bad_request


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (errors.InvalidArgument("top_k", "bad"), 400, "invalid_request_error"),
        (errors.Unauthenticated("invalid API key"), 401, "authentication_error"),
        (errors.PermissionDenied("another tenant's"), 403, "permission_error"),
        (errors.NotFound("gone"), 404, "not_found_error"),
        (errors.Conflict("the session moved on"), 409, "conflict_error"),
        (errors.Overloaded("busy", retry_after_s=2.5), 429, "rate_limit_error"),
        (errors.DependencyUnavailable("no replica"), 503, "service_unavailable_error"),
        (errors.DeadlineExceeded("late"), 504, "timeout_error"),
        (ValueError("plain bad input"), 400, "invalid_request_error"),
        (ConnectionError("redis down"), 503, "service_unavailable_error"),
    ],
)
def test_each_domain_error_has_its_status_and_shape(exc: Exception, status: int, kind: str) -> None:
    error = api_error(exc)
    body = error.body()["error"]
    assert error.status == status
    assert isinstance(body, dict) and body["type"] == kind and body["message"]
    assert set(body) == {"message", "type", "param", "code"}


def test_unknown_model_is_404_naming_the_served_ones() -> None:
    error = api_error(errors.InvalidArgument("model", "unknown model 'x'; this router serves: m1, m2"))
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
    assert "m1, m2" in error.message


def test_overload_says_when_to_retry_in_whole_seconds() -> None:
    assert api_error(errors.Overloaded("busy", retry_after_s=2.1)).headers() == {"Retry-After": "3"}


def test_a_quota_waiting_does_not_end_tells_the_openai_sdks_not_to_retry() -> None:
    """A full session: the SDKs retry every 429 unless told not to, and each retry of the turn
    was another whole answer whose save was refused again."""
    error = api_error(errors.LimitExceeded("session 's1': limit exceeded: 1000 turns"))
    assert (error.status, error.type, error.code) == (429, "insufficient_quota", "insufficient_quota")
    assert error.headers() == {"x-should-retry": "false"}


def test_a_grpc_status_is_mapped_by_its_code() -> None:
    class Rejected(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "session service down"

    error = api_error(Rejected())
    assert (error.status, error.message) == (503, "session service down")


def test_a_bug_is_a_logged_500_without_its_details(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, "llmmesh.router.openai"):
        error = api_error(RuntimeError("secret internals"), "/v1/chat/completions")
    assert error.status == 500 and error.type == "server_error"
    assert "secret internals" not in error.message
    assert "secret internals" in caplog.text  # once, in the log, with its traceback


def test_a_huge_value_quoted_in_a_message_is_clipped_and_says_how_much_was_left_out() -> None:
    name = "m" * 1_000_000
    error = api_error(errors.InvalidArgument("model", f"unknown model {name!r}; served: a, b"))
    message = error.body()["error"]["message"]  # type: ignore[index]
    assert len(message) <= MAX_MESSAGE_CHARS
    assert message.startswith("model: unknown model 'mmm") and message.endswith("served: a, b")
    assert f"[{len(error.message) - MAX_MESSAGE_CHARS} characters left out]" in message
    short = bad_request("stop", "stop: at most 4 sequences")
    assert short.body()["error"]["message"] == "stop: at most 4 sequences"  # type: ignore[index]
