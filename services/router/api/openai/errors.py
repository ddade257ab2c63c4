"""The one table from the mesh's errors (and gRPC codes) to OpenAI-shaped HTTP errors."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass

import grpc

from services.common import errors
from services.common.grpc_status import status_for

log = logging.getLogger("llmmesh.router.openai")

#: The most characters of an error message (and of the field it names) a client is sent: a
#: message quoting what the client sent (a model name, a header, a key) would otherwise echo a
#: megabyte back, and a log line quoting it would write one.
MAX_MESSAGE_CHARS = 1024


def clipped(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text``, or its start and end around a note of how much was left out when it is longer than ``limit``."""
    if len(text) <= limit:
        return text
    tail = limit // 4
    note = f" … [{len(text) - limit} characters left out] … "
    return text[: limit - tail - len(note)] + note + text[-tail:]


@dataclass(frozen=True)
class ApiError(Exception):
    """An error as an OpenAI client reads it: an HTTP status and ``{"error": {...}}``."""

    status: int
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    #: Seconds, for the ``Retry-After`` header of a 429 or 503.
    retry_after_s: float | None = None
    #: False for a 429 that waiting does not end (a used-up quota: a full session): the
    #: ``x-should-retry: false`` header keeps the OpenAI SDKs from retrying it, as they
    #: retry every other 429 (each retry of a turn whose save fails is another whole answer).
    retryable: bool = True

    def body(self) -> dict[str, object]:
        param = clipped(self.param) if self.param is not None else None
        return {
            "error": {"message": clipped(self.message), "type": self.type, "param": param, "code": self.code}
        }

    def headers(self) -> dict[str, str]:
        if not self.retryable:
            return {"x-should-retry": "false"}
        if self.retry_after_s is None:
            return {}
        # Retry-After takes whole seconds; rounding down would invite a retry that is refused again.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def bad_request(param: str | None, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


def unsupported(param: str, what: str) -> ApiError:
    """A field that would change the answer and that this server cannot honour: refused, never ignored."""
    return ApiError(400, f"{param}: {what}", "invalid_request_error", "unsupported_parameter", param)


# (HTTP status, OpenAI error type, error code) by gRPC status: the one place the two vocabularies meet.
_BY_CODE: dict[grpc.StatusCode, tuple[int, str, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "failed_precondition"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error", "already_exists"),
    grpc.StatusCode.ABORTED: (409, "conflict_error", "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error", "cancelled"),
}
_INTERNAL = (500, "server_error", "internal_error")


_NAMED_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


def api_error(exc: BaseException, route: str = "") -> ApiError:
    """What the client is told about ``exc``; anything the table does not know is a bug, logged once here."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, grpc.RpcError) and isinstance(
        code := getattr(exc, "code", lambda: None)(), grpc.StatusCode
    ):
        message = getattr(exc, "details", lambda: "")() or code.name
    else:
        code = status_for(exc)
        message = str(exc) or type(exc).__name__
    status, kind, error_code = _BY_CODE.get(code, _INTERNAL)
    param = getattr(exc, "field", None) if isinstance(exc, errors.InvalidArgument) else None
    if param is None and code == grpc.StatusCode.INVALID_ARGUMENT:
        # A replica's refusal passed on as a status ("json_schema: does not compile: …"): its field.
        named = _NAMED_FIELD.match(message)
        param = named.group(1) if named else None
    if code == grpc.StatusCode.INVALID_ARGUMENT and errors.is_context_too_long(message):
        # OpenAI's code for it: the clients that trim a conversation to fit look for this one.
        error_code = "context_length_exceeded"
    if param == "model" and "unknown model" in message:
        # The catalog names the models it serves in the message: OpenAI says 404 for a model it lacks.
        return ApiError(404, message, "invalid_request_error", "model_not_found", "model")
    if isinstance(exc, errors.LimitExceeded):
        # OpenAI's own answer to a used-up quota: 429 insufficient_quota, not to be retried.
        return ApiError(429, message, "insufficient_quota", "insufficient_quota", None, retryable=False)
    retry_after = None
    if status == 429:
        retry_after = exc.retry_after_s if isinstance(exc, errors.Overloaded) else 1.0
    if status == 500:
        log.error("%s failed", route or "HTTP request", exc_info=exc)
        message = f"internal error: {type(exc).__name__}"
    return ApiError(status, message, kind, error_code, param, retry_after)


def renamed(error: ApiError, engine: str, request: str) -> ApiError:
    """``error`` naming the request's field ``request`` where the engine named its own ``engine``."""
    if error.param != engine:
        return error
    message = error.message
    if message.startswith(f"{engine}:"):
        message = request + message[len(engine) :]
    return dataclasses.replace(error, param=request, message=message)


@dataclass(frozen=True)
class ConstraintParam:
    """The request's own name for the output constraint it set.

    A replica refuses a constraint naming its proto field ("choice: no token of this model's
    vocabulary can begin its output"), but the client sent ``guided_choice`` (or
    ``response_format.json_schema.schema``, ``tools``, …): the error names what it sent.
    """

    #: The proto field (``SamplingParams``'s ``constraint`` oneof) the request's constraint is in.
    engine: str
    #: The request field it came from.
    request: str

    def rename(self, error: ApiError) -> ApiError:
        return renamed(error, self.engine, self.request)


def utf8_text(text: str, where: str) -> str:
    """JSON may escape a lone surrogate, which no UTF-8 text (so no proto string) can hold."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise bad_request(where, f"{where}: must be valid Unicode text (no lone surrogates)") from None
    return text
