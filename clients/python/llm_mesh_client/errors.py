"""Typed errors: every failed call raises a MeshError subclass carrying the gRPC code and message."""

from __future__ import annotations

import grpc


class MeshError(Exception):
    """A call the router refused or could not finish. ``code`` is the gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(MeshError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(MeshError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(MeshError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Unauthenticated(MeshError):
    """No API key, or one the router does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(MeshError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(MeshError):
    """Rate limit or quota: worth retrying later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(MeshError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(MeshError):
    code = grpc.StatusCode.ABORTED


class Unavailable(MeshError):
    """Nothing answered at the address, or the mesh is restarting: worth retrying."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(MeshError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(MeshError):
    code = grpc.StatusCode.CANCELLED


class Unimplemented(MeshError):
    code = grpc.StatusCode.UNIMPLEMENTED


class StreamEnded(MeshError):
    """The router closed a turn's stream without sending the turn's end."""


_BY_CODE: dict[grpc.StatusCode, type[MeshError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        Unauthenticated,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Unimplemented,
    )
}


def error_from_rpc(error: grpc.RpcError) -> MeshError:
    """The typed error for a failed gRPC call (sync or asyncio)."""
    if isinstance(error, grpc.Call | grpc.aio.AioRpcError):
        code, details = error.code(), error.details() or ""
    else:  # pragma: no cover - grpc raises RpcError subclasses that are Calls
        code, details = grpc.StatusCode.UNKNOWN, str(error)
    cls = _BY_CODE.get(code, MeshError)
    return cls(details, code)
