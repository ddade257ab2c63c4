"""How one attempt on one replica can end badly, and what a replica's error means for the turn.

The relay retries or fails over on an ``AttemptFailed`` (another replica may
do better); everything else it raises to the turn as it is: a client error
(``ReplicaRejected``), a request the engine failed on alone (``RequestFaulted``),
the client's own deadline.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from services.common import errors
from services.common.grpc_status import domain_code
from services.gen.llmmesh.v1 import inference_pb2
from services.router.placement.outliers import FailureKind

# Replica answers the client must see as they are: retrying elsewhere would fail the same way.
CLIENT_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.NOT_FOUND,
    }
)


class ReplicaRejected(errors.MeshError):
    """A replica refused the request for a reason that is the client's to fix."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = domain_code(code)


class RequestFaulted(errors.RequestFault):
    """The replica's engine failed on this request alone (``GenerationError.request_fault``):
    the replica is healthy, so it is neither ejected nor tried again elsewhere."""


class AttemptFailed(Exception):
    """One attempt on one replica failed in a way another replica may not."""

    def __init__(self, reason: str, kind: FailureKind | None) -> None:
        super().__init__(reason)
        self.kind = kind


class ReplicaBusy(AttemptFailed):
    """A replica refused the attempt as busy (RESOURCE_EXHAUSTED): not broken, so not ejected."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, None)


#: What a client refused because every replica was busy is told to wait before trying again:
#: the engine's own RetryInfo for a full queue (a replica's error event carries no delay).
BUSY_RETRY_AFTER_S = 1.0


def replica_failure(
    address: str, error: inference_pb2.GenerationError, deadline: float | None, now: Callable[[], float]
) -> Exception:
    """What a replica's ``GenerationError`` means for this turn."""
    if error.request_fault:
        return RequestFaulted(f"{address}: {error.message}")
    code = _STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN)
    return classify(code, error.message, deadline, now)


def classify(
    code: grpc.StatusCode, details: str, deadline: float | None, now: Callable[[], float]
) -> Exception:
    """A replica's status as the relay acts on it: passed on, a deadline, busy, or retried elsewhere."""
    if code in CLIENT_ERROR_CODES:
        return ReplicaRejected(code, details or code.name)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None and now() >= deadline - 0.01:
        return errors.DeadlineExceeded("deadline exceeded while the replica was generating")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ReplicaBusy(f"busy: {details}")
    return AttemptFailed(f"{code.name}: {details}", FailureKind.ERROR)


#: google.rpc.Code number → grpc.StatusCode, for the error events of a shared stream.
_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
