"""Hypothesis strategies that build any value of any protobuf message from its descriptor."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

INT32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31)]))
UINT32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**32 - 1]))
INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
#: Finite floats where numerics break: float32's smallest subnormal and normal, values whose
#: reciprocal overflows, float32's largest, and both sides of the engine's documented bounds
#: (temperature 1e-5, repetition penalty 0.01 and 100).
BOUNDARY_FLOATS = st.sampled_from(
    [
        *(1.4e-45, 1e-40, 1.18e-38, 1e-30, 1e-10, 9.9e-6, 1e-5, 1.1e-5),
        *(0.0099, 0.01, 0.0101, 99.9, 100.0, 100.1, 1e10, 1e30, 3.4e38, -1.4e-45, -3.4e38),
    ]
)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 2.0, float("nan"), float("inf")]),
    BOUNDARY_FLOATS,
)
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "user", "assistant", "system", " ", "a" * 300]))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return INT32
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return UINT32
    if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return INT64
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return UINT64
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return FLOATS
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return TEXT
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(0, 50))
    raise TypeError(f"unsupported field type {t}")


def messages(descriptor: Descriptor, cls: type[Message], depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of ``cls``: every field may be unset, extreme, or garbage-but-typed."""

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        for field in descriptor.fields:
            if not draw(st.booleans()):
                continue
            if field.containing_oneof is not None and msg.WhichOneof(field.containing_oneof.name):
                continue
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                value_field = field.message_type.fields_by_name["value"]
                if value_field.message_type is not None:
                    continue
                key_field = field.message_type.fields_by_name["key"]
                entries = draw(st.dictionaries(_scalar(key_field), _scalar(value_field), max_size=3))
                getattr(msg, field.name).update(entries)
            elif field.message_type is not None:
                if depth >= 3:
                    continue
                sub_cls = type(getattr(msg, field.name)) if not _repeated(field) else None
                if _repeated(field):
                    container = getattr(msg, field.name)
                    for _ in range(draw(st.integers(0, 3))):
                        child = container.add()
                        child.CopyFrom(draw(messages(field.message_type, type(child), depth + 1)))
                else:
                    assert sub_cls is not None
                    getattr(msg, field.name).CopyFrom(draw(messages(field.message_type, sub_cls, depth + 1)))
            elif _repeated(field):
                getattr(msg, field.name).extend(draw(st.lists(_scalar(field), max_size=4)))
            else:
                setattr(msg, field.name, draw(_scalar(field)))
        return msg

    return build()


def _repeated(field: FieldDescriptor) -> bool:
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)
