"""Which encoding a text document's bytes are in: a byte-order mark, the charset its MIME type
declares, else UTF-8. Never a guess: detectors (charset-normalizer, measured on a Windows-1252
paragraph) name a near-miss codepage and turn "crème" into "crčme" without a sign, so a
document in another encoding is refused with the way to declare it, not indexed as mojibake."""

from __future__ import annotations

import codecs
import re

from services.common.errors import InvalidArgument

# UTF-32's marks first: UTF-32-LE's begins with UTF-16-LE's.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
#: IANA's charset names are at most 40 characters (RFC 2978).
MAX_CHARSET_CHARS = 40
_CHARSET = re.compile(r""";\s*charset\s*=\s*"?([^";\s]+)"?""", re.IGNORECASE)


def declared_charset(mime_type: str) -> str | None:
    """The ``charset`` parameter of ``mime_type`` (``text/plain; charset=windows-1252``), checked
    to be a text encoding Python knows; None when there is none. Python's codec registry also
    holds bytes-to-bytes codecs (``hex``, ``base64``, ``zlib``, ``rot13``) that decode no text,
    and reads names padded with any punctuation (``utf------8``), which made the stored MIME
    type too long for its field: both once reached the store as INTERNAL errors."""
    match = _CHARSET.search(mime_type)
    if match is None:
        return None
    name = match.group(1)
    if len(name) > MAX_CHARSET_CHARS:
        raise InvalidArgument(
            "header.mime_type", f"a charset name has at most {MAX_CHARSET_CHARS} characters"
        )
    try:
        codec = codecs.lookup(name)
    except LookupError:
        raise InvalidArgument("header.mime_type", f"unknown charset {name[:64]!r}") from None
    if not getattr(codec, "_is_text_encoding", True):
        raise InvalidArgument("header.mime_type", f"charset {name[:64]!r} is not a text encoding")
    try:
        # Python's "undefined" codec is found but refuses to decode anything: it reached the
        # parsers as a bare UnicodeError, answered without naming the field.
        codecs.decode(b"", name)
    except (LookupError, UnicodeError):
        raise InvalidArgument("header.mime_type", f"charset {name[:64]!r} decodes no text") from None
    return name


def decode_text(data: bytes, charset: str | None) -> str:
    """``data`` as text: by its byte-order mark, else by ``charset``, else as UTF-8."""
    encoding = next((name for bom, name in _BOMS if data.startswith(bom)), None) or charset or "UTF-8"
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        hint = (
            ""
            if charset
            else "; declare its encoding in the MIME type, e.g. 'text/plain; charset=windows-1252'"
        )
        raise InvalidArgument("data", f"text is not valid {encoding} (byte {exc.start}){hint}") from exc
    except (LookupError, UnicodeError) as exc:  # the codec itself failed, not the bytes
        raise InvalidArgument("header.mime_type", f"charset {encoding[:64]!r} decodes no text") from exc
