"""Domain status ↔ gRPC status: the one place a ``Code`` becomes a ``grpc.StatusCode`` and back."""

from __future__ import annotations

import grpc

from services.common.errors import Code, code_for

# gRPC's status codes are the canonical codes under the same names and numbers.
_TO_GRPC = {code: grpc.StatusCode[code.name] for code in Code}
_FROM_GRPC = {status: code for code, status in _TO_GRPC.items()}


def domain_code(status: grpc.StatusCode) -> Code:
    """The domain code of a status another service answered with (to raise it on as a MeshError)."""
    return _FROM_GRPC[status]


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for an exception raised by a handler (the table is ``errors.code_for``)."""
    return _TO_GRPC[code_for(exc)]
