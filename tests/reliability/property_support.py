"""Shared checks for the property-based request tests (reliability matrix row 11)."""

from __future__ import annotations

import grpc
from google.protobuf.descriptor import Descriptor

# Codes a well-behaved service may answer to arbitrary, well-typed input.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}


def field_names(descriptor: Descriptor, depth: int = 0) -> set[str]:
    """Every field name reachable from a message, for checking error messages."""
    names = set()
    for field in descriptor.fields:
        names.add(field.name)
        if field.message_type is not None and depth < 4:
            names |= field_names(field.message_type, depth + 1)
    return names


def check_status(
    code: grpc.StatusCode, details: str, descriptor: Descriptor, extra_names: set[str] = frozenset()
) -> None:  # type: ignore[assignment]
    assert code in ALLOWED, f"unexpected {code.name}: {details}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        names = field_names(descriptor) | set(extra_names)
        assert any(name in details for name in names), f"INVALID_ARGUMENT does not name a field: {details!r}"
