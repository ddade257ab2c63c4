"""Milvus filter expressions made safe: digests for user-chosen keys, quoted literals, metadata terms.

Filters only ever embed hex digests and validated metadata keys; user strings
that must appear in a filter (metadata values) are quoted as Milvus literals.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

from services.common.errors import InvalidArgument

#: A metadata key, checked with ``fullmatch``: a ``$`` anchor also matches before a final "\n",
#: which let a key ending in a newline through into a Milvus filter (an INTERNAL error).
METADATA_KEY_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def digest(*parts: str) -> str:
    """A fixed-length key for user-chosen strings (tenant, document id): safe in any filter."""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:40]


#: What a Milvus filter string literal must escape. Every other character may stand as it is;
#: JSON's \u escapes (json.dumps writes them for control characters) are a parse error in Milvus.
_MILVUS_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r"})


def milvus_string(value: str) -> str:
    """``value`` as a double-quoted string literal in a Milvus filter expression."""
    return '"' + value.translate(_MILVUS_ESCAPES) + '"'


def metadata_condition(metadata_filter: Mapping[str, str]) -> str:
    """A Milvus filter requiring every key/value pair in a chunk's metadata."""
    terms = []
    for key, value in sorted(metadata_filter.items()):
        if not METADATA_KEY_RE.fullmatch(key):
            raise InvalidArgument(
                "metadata_filter", f"key {key!r} must be 1-64 of letters, digits, '_', '.', '-'"
            )
        terms.append(f'metadata["{key}"] == {milvus_string(value)}')
    return " and ".join(terms)
