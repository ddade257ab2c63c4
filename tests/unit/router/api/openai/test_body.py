"""Request bytes → JSON: content codings undone within the limit, nesting bounded, lone surrogates
refused by path, and nothing a real client sends refused by mistake."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest

from services.router.api.openai.body import MAX_DEPTH, decoded, parsed
from services.router.api.openai.errors import ApiError


def refused(call: object, *args: object) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)  # type: ignore[operator]
    return caught.value


def _nested(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


def test_nesting_up_to_the_limit_is_read_and_one_level_more_is_refused_naming_the_field() -> None:
    # The body is level 1, so a field may hold MAX_DEPTH - 1 levels of its own.
    fits = json.dumps({"guided_json": _nested(MAX_DEPTH - 1)}).encode()
    assert parsed(fits)["guided_json"] == _nested(MAX_DEPTH - 1)
    error = refused(parsed, json.dumps({"model": "m", "guided_json": _nested(MAX_DEPTH)}).encode())
    assert (error.status, error.param, error.code) == (400, "guided_json", "invalid_value")
    whole = refused(parsed, json.dumps(_nested(MAX_DEPTH + 1)).encode())
    assert whole.param is None and "nested" in whole.message


def test_brackets_inside_strings_are_text_not_nesting() -> None:
    # Strings full of brackets (and escaped quotes before them) nest nothing: read as sent.
    text = '\\"[' * (2 * MAX_DEPTH) + "{" * MAX_DEPTH
    body = {"messages": [{"role": "user", "content": text}], "stop": ["]]", "[[" * MAX_DEPTH]}
    assert parsed(json.dumps(body).encode()) == body
    # ...and a bracket-laden string does not hide real nesting next to it.
    deep = {"stop": ["]" * (4 * MAX_DEPTH)], "guided_json": _nested(MAX_DEPTH)}
    assert refused(parsed, json.dumps(deep).encode()).param == "guided_json"


def test_a_wide_body_is_not_deep_and_a_deep_field_among_wide_ones_is_named() -> None:
    wide = {"model": "m", "logit_bias_like": [[] for _ in range(50_000)], "x": [{"a": [1]}] * 1_000}
    assert parsed(json.dumps(wide).encode()) == wide
    wide["grammar"] = {"k": _nested(MAX_DEPTH - 1)}  # MAX_DEPTH - 1 levels under one more: too deep
    error = refused(parsed, json.dumps(wide).encode())
    assert (error.status, error.param) == (400, "grammar") and f"{MAX_DEPTH} levels" in error.message


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32-le"])
def test_nesting_is_counted_in_characters_whatever_the_unicode_encoding(encoding: str) -> None:
    # json.loads reads UTF-16/32 bodies too; there every character is 2 or 4 bytes.
    # U+5C22 is the bytes '"' and '\\' in UTF-16-LE and UTF-32-LE: read as bytes, it ends the
    # string early and turns its brackets into nesting (or hides real nesting behind them).
    text = "\u5c22" + "[[[[" * MAX_DEPTH
    fits = json.dumps({"guided_json": _nested(MAX_DEPTH - 1), "s": text}, ensure_ascii=False)
    assert parsed(fits.encode(encoding))["guided_json"] == _nested(MAX_DEPTH - 1)
    hiding = "\u5c22" + "]]]]" * MAX_DEPTH
    deep = json.dumps({"s": hiding, "guided_json": _nested(MAX_DEPTH)}, ensure_ascii=False)
    assert refused(parsed, deep.encode(encoding)).param == "guided_json"


def test_escaped_surrogate_pairs_are_whole_characters_and_a_lone_half_is_named_by_path() -> None:
    # What json.dumps (ensure_ascii, the default of Python's requests) writes for an emoji.
    body = json.dumps({"messages": [{"role": "user", "content": "hi 😀"}]}).encode()
    assert b"\\ud83d\\ude00" in body
    assert parsed(body)["messages"][0]["content"] == "hi 😀"
    raw = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ude00"}]}]}'
    error = refused(parsed, raw)
    assert (error.status, error.param) == (400, "messages[0].content[0].text")
    assert refused(parsed, '{"a\udc00": 1}'.encode("utf-16", "surrogatepass")).param == "a\\udc00"


@pytest.mark.parametrize(
    ("coding", "data"),
    [
        ("gzip", gzip.compress(b'{"a": ', mtime=0) + gzip.compress(b"1}", mtime=0)),  # two gzip members
        ("deflate, gzip", gzip.compress(zlib.compress(b'{"a": 1}'), mtime=0)),  # applied in the order listed
        ("identity, gzip", gzip.compress(b'{"a": 1}', mtime=0)),
    ],
    # Named ids: pytest-xdist's workers must collect the same names, and gzip stamps the time into its header.
    ids=["two-gzip-members", "deflate-then-gzip", "identity-then-gzip"],
)
def test_content_codings_are_undone(coding: str, data: bytes) -> None:
    assert parsed(decoded(data, coding, 1024)) == {"a": 1}


def test_an_inflated_body_is_bounded_by_the_limit_not_its_compressed_size() -> None:
    assert refused(decoded, gzip.compress(b" " * 1025), "gzip", 1024).status == 413
    assert len(decoded(gzip.compress(b" " * 1024), "gzip", 1024)) == 1024
