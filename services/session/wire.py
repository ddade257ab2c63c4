"""Request decoding that reports invalid UTF-8 as INVALID_ARGUMENT naming the field.

protobuf refuses a string field with bad UTF-8 and gRPC would answer INTERNAL. Instead the
service re-reads such a request with a "bytes twin" of session.proto (every string field
made bytes, which is the same wire format) to find the offending field and name it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from services.common.errors import InvalidArgument
from services.gen.llmmesh.v1 import session_pb2

_PACKAGE = "llmmesh.v1"
_TWIN_PACKAGE = "llmmesh.v1.wiretwin"


@dataclass(frozen=True)
class UndecodableRequest:
    """Stands in for a request protobuf could not parse; the handler raises ``error``."""

    error: InvalidArgument


def _twin_message(proto: descriptor_pb2.DescriptorProto) -> None:
    # Map entries become plain repeated messages: a bytes map key is not allowed, the wire is the same.
    proto.options.ClearField("map_entry")
    for field in proto.field:
        if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
            field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
        if field.type_name.startswith(f".{_PACKAGE}."):
            field.type_name = f".{_TWIN_PACKAGE}." + field.type_name[len(_PACKAGE) + 2 :]
    for nested in proto.nested_type:
        _twin_message(nested)


@cache
def _twin_pool() -> descriptor_pool.DescriptorPool:
    file_proto = descriptor_pb2.FileDescriptorProto()
    session_pb2.DESCRIPTOR.CopyToProto(file_proto)
    file_proto.name = "llmmesh/v1/session_wiretwin.proto"
    file_proto.package = _TWIN_PACKAGE
    file_proto.ClearField("service")
    for message in file_proto.message_type:
        _twin_message(message)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    return pool


def _bad_utf8_path(twin: Message, original: Descriptor, prefix: str = "") -> str | None:
    """The dotted path of the first string field in ``twin`` holding invalid UTF-8."""
    for twin_field, value in twin.ListFields():
        field = original.fields_by_name[twin_field.name]
        path = f"{prefix}{field.name}"
        values: list[Any] = list(value) if twin_field.is_repeated else [value]
        for i, item in enumerate(values):
            item_path = f"{path}[{i}]" if twin_field.is_repeated and not _is_map(field) else path
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return item_path
            elif field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None:
                found = _bad_utf8_path(item, field.message_type, item_path + ".")
                if found:
                    return found
    return None


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def diagnose(message_type: type[Message], data: bytes) -> InvalidArgument:
    """Why ``data`` is not a valid ``message_type``, naming the field where possible."""
    name = message_type.DESCRIPTOR.full_name.replace(_PACKAGE, _TWIN_PACKAGE, 1)
    twin_type = message_factory.GetMessageClass(_twin_pool().FindMessageTypeByName(name))
    try:
        twin = twin_type.FromString(data)
    except DecodeError:
        return InvalidArgument("request", "is not a valid protobuf message")
    path = _bad_utf8_path(twin, cast(Descriptor, message_type.DESCRIPTOR))
    if path is None:
        return InvalidArgument("request", "is not a valid protobuf message")
    return InvalidArgument(path, "is not valid UTF-8")


def tolerant_deserializer(message_type: type[Message]) -> Callable[[bytes], Message | UndecodableRequest]:
    """A gRPC request deserializer that hands the handler a diagnosis instead of failing."""

    def deserialize(data: bytes) -> Message | UndecodableRequest:
        try:
            return message_type.FromString(data)
        except DecodeError:
            return UndecodableRequest(diagnose(message_type, data))

    return deserialize
