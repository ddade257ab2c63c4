"""A request body's bytes → JSON the endpoints can read: decompressed, parsed, and checked for what no
field can hold.

Three things every endpoint needs before it looks at a field:

* ``Content-Encoding``: ``gzip``, ``x-gzip`` and ``deflate`` (zlib-wrapped or raw) are inflated,
  as OpenAI's own API does, bounded by the body limit (a 5 KiB gzip of 5 MiB is a 413, not 5 MiB in
  memory); any other coding is a 415 naming the header, since parsing its bytes as JSON would only
  work by accident when they were not compressed at all.
* Nesting: at most ``MAX_DEPTH`` levels. ``json.loads`` takes ~960 on the front's stack, but a
  schema nested that deep then ran out of stack in ``json.dumps`` (a 500), and nothing the front or
  the replica's grammar compiler (llguidance reads JSON with serde_json's 128-level limit) serves
  needs more. The depth is read from the bytes (strings blanked by a regex, then a running count
  of brackets in numpy), not by walking the parsed values: a walk in Python held the event loop
  for about a second on a 4 MiB body of a million empty arrays, and every other request with it
  (now ≈ 0.09 s, most of it ``json.loads``).
* Text: JSON may escape a lone surrogate (``"\\ud800"``), and ``json.loads`` decodes raw surrogate
  bytes too (``surrogatepass``); no UTF-8 text holds one, so no proto string, no log line and no
  error message quoting it can either (a key echoed in an error message made the answer a 500).
  It is refused wherever it is, keys included, naming the path to it.
"""

from __future__ import annotations

import gc
import json
import math
import re
import zlib
from typing import Any

import numpy as np

from services.router.api.openai.errors import ApiError, bad_request, clipped

#: Levels of arrays and objects a body may nest, the body itself counting as one.
MAX_DEPTH = 128
#: A JSON string (the body already parsed and in UTF-8, so every one is well formed): brackets
#: inside it are text. Possessive, so no input can make the match backtrack.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
#: Each byte's step in nesting depth: +1 opens an array or object, -1 closes one.
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1
_INFLATE = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"the request body is larger than {limit} bytes", "invalid_request_error", "request_too_large"
    )


def decoded(raw: bytes, content_encoding: str | None, limit: int) -> bytes:
    """``raw`` with its content codings undone (last applied, first undone); at most ``limit`` bytes."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    for coding in reversed(codings):
        if coding not in _INFLATE:
            raise ApiError(
                415,
                f"header Content-Encoding: {coding!r} is not supported; send gzip, deflate or identity",
                "invalid_request_error",
                "unsupported_content_encoding",
                "Content-Encoding",
            )
        raw = _inflate(raw, coding, limit)
    return raw


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    wbits = _INFLATE[coding]
    out = bytearray()
    try:
        while True:  # a gzip body may be several members, one after another
            try:
                inflater = zlib.decompressobj(wbits)
                out += inflater.decompress(data, limit + 1 - len(out))
            except zlib.error:
                if coding != "deflate" or out:
                    raise
                # "deflate" without its zlib wrapper: what some clients send under that name.
                inflater = zlib.decompressobj(-zlib.MAX_WBITS)
                out += inflater.decompress(data, limit + 1 - len(out))
            if len(out) > limit:
                raise too_large(limit)
            if not inflater.eof:
                raise zlib.error("the compressed body ends early")
            data = inflater.unused_data
            if not data or wbits != _INFLATE["gzip"]:
                break
    except zlib.error as exc:
        raise bad_request(
            "Content-Encoding",
            f"header Content-Encoding: the body is not valid {coding} data ({exc})",
            "invalid_body_encoding",
        ) from None
    return bytes(out)


def parsed(raw: bytes) -> Any:
    """The body as JSON, or a 400: not JSON, nested deeper than ``MAX_DEPTH``, or a lone surrogate."""
    # The cyclic GC paused while parsing: JSON makes no cycles, and a body of a million small
    # arrays otherwise set off a collection every 700 of them (0.17 s of parsing → 0.06 s).
    collecting = gc.isenabled()
    gc.disable()
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(
            None, f"the request body is nested more than {MAX_DEPTH} levels deep", "invalid_json"
        ) from None
    except ValueError as exc:
        raise bad_request(None, f"the request body is not valid JSON: {exc}", "invalid_json") from None
    finally:
        if collecting:
            gc.enable()
    _check_depth(body, raw)
    if not _surely_valid_text(raw) and (where := _lone_surrogate(body)) is not None:
        raise bad_request(
            where, f"{where}: must be valid Unicode text (a lone surrogate such as \\ud800 is not)"
        )
    return body


def _check_depth(body: Any, raw: bytes) -> None:
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return  # too few brackets to nest that deep: most bodies stop here
    if _depth(_utf8(raw)) <= MAX_DEPTH:
        return
    # Too deep: name the top-level field it is under. Re-encoding a value runs at C speed, and a
    # value too deep for the encoder's own stack is the one.
    if isinstance(body, dict):
        for key, value in body.items():
            if isinstance(value, (dict, list)) and _too_deep(value, MAX_DEPTH - 1):
                name = _printable(key)
                raise bad_request(clipped(name), f"{name}: nested more than {MAX_DEPTH} levels deep")
    raise bad_request(None, f"the request body is nested more than {MAX_DEPTH} levels deep")


def _depth(text: bytes) -> int:
    """How deep the arrays and objects of the valid JSON ``text`` nest (0 for a bare scalar)."""
    steps = _DEPTH_STEP[np.frombuffer(_STRING.sub(b'""', text), dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def _too_deep(value: Any, limit: int) -> bool:
    try:
        text = json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    except RecursionError:
        return True
    return _depth(text) > limit


def _utf8(raw: bytes) -> bytes:
    """``raw`` as UTF-8: ``json.loads`` also reads UTF-16 and UTF-32, where a byte is not a character."""
    encoding = json.detect_encoding(raw)
    if encoding == "utf-8":
        return raw
    return raw.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")


def _surely_valid_text(raw: bytes) -> bool:
    """True when no string in ``raw`` can hold a surrogate: strict UTF-8 with no ``\\u`` escape."""
    if b"\\u" in raw:
        return False
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False  # surrogate bytes, or UTF-16/32 (which json.loads reads too)
    return True


def _lone_surrogate(body: Any) -> str | None:
    """The path (``messages[0].content``) to the first string or key holding a lone surrogate."""
    try:
        json.dumps(body, ensure_ascii=False).encode()
        return None  # the common case, at C speed: escaped pairs (emoji) are whole characters
    except UnicodeEncodeError:
        pass
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _encodes(value):
                return path or None
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                child = f"{path}.{_printable(key)}" if path else _printable(key)
                if not _encodes(key):
                    return child
                stack.append((item, child))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in reversed(list(enumerate(value))))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _printable(key: str) -> str:
    """A key as an error message can name it: a lone surrogate written as its escape."""
    return key.encode("utf-8", "backslashreplace").decode()


def finite_number(value: Any) -> float | None:
    """A JSON number as a finite float, or None: not a number (``true`` is none), or one no
    float holds. JSON integers have no bound (``json.loads`` reads 4,300 digits), and
    ``math.isfinite`` of one past float's range raises ``OverflowError``: that was a 500."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
