"""What a client reads in a status a handler's error became: its own problem named, never the
mesh's internal addresses."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import redis.exceptions

from services.common import errors
from services.common.server import abort_for


class AbortedContext:
    """The part of a servicer context ``abort_for`` uses: the status it ends the call with."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.message = ""

    async def abort(self, code: grpc.StatusCode, message: str, trailing_metadata: Any = ()) -> None:
        self.code, self.message = code, message


@pytest.mark.parametrize(
    ("exc", "shown"),
    [
        (
            redis.exceptions.ConnectionError("Error 111 connecting to 10.0.0.5:6379. Connection refused."),
            "Redis is unavailable; try again",
        ),
        (
            redis.exceptions.TimeoutError("Timeout reading from 10.0.0.5:6379"),
            "Redis is unavailable; try again",
        ),
        (
            ConnectionRefusedError(111, "Connection refused to 10.0.0.5"),
            "a dependency is unavailable; try again",
        ),
    ],
)
async def test_a_dependency_clients_own_error_reaches_the_caller_without_its_address(
    exc: BaseException, shown: str
) -> None:
    # The session service and the router's task API answered UNAVAILABLE with the Redis client's
    # text: every tenant learned the mesh's Redis address (and the router put it in degraded reasons).
    context = AbortedContext()
    await abort_for(exc, context, "/llmmesh.v1.Session/GetSession")  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert context.message == shown and "10.0.0.5" not in context.message


async def test_the_meshs_own_unavailable_keeps_its_message() -> None:
    context = AbortedContext()
    outage = errors.DependencyUnavailable("session service not configured (--session-addr)")
    await abort_for(outage, context, "/llmmesh.v1.Router/Chat")  # type: ignore[arg-type]
    assert (context.code, context.message) == (
        grpc.StatusCode.UNAVAILABLE,
        "session service not configured (--session-addr)",
    )


async def test_a_bugs_own_text_stays_in_the_log_and_the_caller_gets_its_type(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # "internal error: KeyError: 'tenant-b:session-9'": a bug's text can hold anything, another
    # request's data included. The HTTP front already showed the type alone.
    context = AbortedContext()
    await abort_for(KeyError("tenant-b:session-9"), context, "/llmmesh.v1.Router/Chat")  # type: ignore[arg-type]
    assert (context.code, context.message) == (grpc.StatusCode.INTERNAL, "internal error: KeyError")
    assert "tenant-b:session-9" in caplog.text  # logged once, with its traceback
    fault = errors.RequestFault("the engine failed on this request's rows: NaN in the logits")
    await abort_for(fault, context, "/llmmesh.v1.Inference/Generate")  # type: ignore[arg-type]
    assert context.message == (
        "internal error: RequestFault: the engine failed on this request's rows: NaN in the logits"
    )
