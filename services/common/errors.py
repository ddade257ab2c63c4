"""Domain errors and the table that turns them into gRPC status codes.

Engines, stores and policies raise these (or ValueError for bad input); only
the error mapping in ``services.common.server`` knows about gRPC codes.
"""

from __future__ import annotations

import grpc


class MeshError(Exception):
    """Base of the errors that map to a specific gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(MeshError, ValueError):
    """Bad input; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(MeshError):
    """The named thing does not exist (or has expired)."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(MeshError):
    """The id is taken."""

    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(MeshError):
    """The thing belongs to another tenant."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(MeshError):
    """Missing, wrong or revoked credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Overloaded(MeshError):
    """Refused to protect the service; the client may retry after a pause."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LimitExceeded(MeshError):
    """A fixed quota (turns per session, sessions per owner, …) is used up."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Conflict(MeshError):
    """Optimistic concurrency lost: the stored version moved on."""

    code = grpc.StatusCode.ABORTED

    def __init__(self, message: str, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.trailing = trailing


class FailedPrecondition(MeshError):
    """The system is not in a state to do this (e.g. wrong embedding model)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DependencyUnavailable(MeshError):
    """A dependency (Redis, Milvus, every replica) cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(MeshError):
    """The caller's deadline passed or cannot be met."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class RequestFault(MeshError):
    """The engine failed on this request's own rows; every other request goes on and the
    replica stays SERVING. Retrying elsewhere would most likely fail the same way."""

    code = grpc.StatusCode.INTERNAL


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for an exception raised by a handler."""
    if isinstance(exc, MeshError):
        return exc.code
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, (ConnectionError, TimeoutError)) or _is_dependency_outage(exc):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def _is_dependency_outage(exc: BaseException) -> bool:
    """Redis and Milvus clients raise their own connection errors (not the builtins):
    an outage of a dependency is UNAVAILABLE to our caller, never INTERNAL."""
    module = type(exc).__module__
    if not module.startswith(("redis", "pymilvus")):
        return False
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"ConnectionError", "TimeoutError", "MilvusUnavailableException"})
