"""Domain errors, each with the canonical status it means; no transport in here.

Engines, stores and policies raise these (or ValueError for bad input). The
status is a ``Code`` (the google.rpc.Code numbers and names, which gRPC's status
codes also are); only ``services.common.grpc_status``, used by the server
bootstrap, turns one into a gRPC status, so the engine and the stores need no gRPC.
"""

from __future__ import annotations

import enum
import re

from google.protobuf.message import DecodeError


class Code(enum.Enum):
    """The canonical status codes (google.rpc.Code): what went wrong, whatever the transport."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class MeshError(Exception):
    """Base of the errors that map to a specific status."""

    code: Code = Code.INTERNAL


class InvalidArgument(MeshError, ValueError):
    """Bad input; the message names the field."""

    code = Code.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


#: How every refusal of a request too long for its model's context ends its message. The
#: status crosses the gRPC hop as text, so this is how the router's OpenAI front knows to say
#: ``context_length_exceeded`` (the code OpenAI's clients look for to trim a conversation).
_CONTEXT_TOO_LONG = re.compile(r"the \d+-token context$")


class ContextTooLong(InvalidArgument):
    """The prompt, or the prompt with ``max_tokens``, does not fit the model's context."""

    def __init__(self, field: str, problem: str, context_tokens: int) -> None:
        super().__init__(field, f"{problem} the {context_tokens}-token context")


def is_context_too_long(message: str) -> bool:
    """``message`` is a ``ContextTooLong``'s, possibly passed on as a status by another service."""
    return _CONTEXT_TOO_LONG.search(message) is not None


class NotFound(MeshError):
    """The named thing does not exist (or has expired)."""

    code = Code.NOT_FOUND


class AlreadyExists(MeshError):
    """The id is taken."""

    code = Code.ALREADY_EXISTS


class PermissionDenied(MeshError):
    """The thing belongs to another tenant."""

    code = Code.PERMISSION_DENIED


class Unauthenticated(MeshError):
    """Missing, wrong or revoked credentials."""

    code = Code.UNAUTHENTICATED


class Overloaded(MeshError):
    """Refused to protect the service; the client may retry after a pause."""

    code = Code.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LimitExceeded(MeshError):
    """A fixed quota (turns per session, sessions per owner, …) is used up."""

    code = Code.RESOURCE_EXHAUSTED


class Conflict(MeshError):
    """Optimistic concurrency lost: the stored version moved on."""

    code = Code.ABORTED

    def __init__(self, message: str, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.trailing = trailing


class FailedPrecondition(MeshError):
    """The system is not in a state to do this (e.g. wrong embedding model)."""

    code = Code.FAILED_PRECONDITION


class DependencyUnavailable(MeshError):
    """A dependency (Redis, Milvus, every replica) cannot be reached."""

    code = Code.UNAVAILABLE


class DeadlineExceeded(MeshError):
    """The caller's deadline passed or cannot be met."""

    code = Code.DEADLINE_EXCEEDED


class RequestFault(MeshError):
    """The engine failed on this request's own rows; every other request goes on and the
    replica stays SERVING. Retrying elsewhere would most likely fail the same way."""

    code = Code.INTERNAL


def code_for(exc: BaseException) -> Code:
    """The status an exception raised by a handler means: the error table."""
    if isinstance(exc, MeshError):
        return exc.code
    if isinstance(exc, (ValueError, DecodeError)):
        # A DecodeError is a message that is not the proto it claims (a string field that is
        # not UTF-8, garbage bytes): the client's input, not a server fault.
        return Code.INVALID_ARGUMENT
    if isinstance(exc, (ConnectionError, TimeoutError)) or _is_dependency_outage(exc):
        return Code.UNAVAILABLE
    return Code.INTERNAL


def _is_dependency_outage(exc: BaseException) -> bool:
    """Redis and Milvus clients raise their own connection errors (not the builtins):
    an outage of a dependency is UNAVAILABLE to our caller, never INTERNAL."""
    module = type(exc).__module__
    if not module.startswith(("redis", "pymilvus")):
        return False
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"ConnectionError", "TimeoutError", "MilvusUnavailableException"})
