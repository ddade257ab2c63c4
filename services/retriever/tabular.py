"""CSV and JSON documents as text a reader (and a search) understands: every value beside its name.

A spreadsheet export or an API dump read as plain text would index ``31,Paris`` with no
word saying what 31 or Paris are; a retrieved chunk must stand alone in a prompt. So each
record becomes one paragraph of ``field: value`` pairs (CSV: the header row's names; JSON:
the dotted path to the value), and the chunker packs records into chunks as it packs
paragraphs. JSON objects at the top level give a section per key that holds an object or a
list, headed by the key; records (an array of objects, or JSON Lines) a paragraph each.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from typing import Any

from services.common.errors import InvalidArgument
from services.retriever.text_encoding import decode_text

CSV = "text/csv"
TSV = "text/tab-separated-values"
JSON = "application/json"
JSON_LINES = "application/x-ndjson"

#: How deep a JSON value may nest before the document is refused (as deep as a search needs).
MAX_JSON_DEPTH = 64
#: The separators a CSV file may use, tried in this order when its sample is ambiguous.
_DELIMITERS = ",;\t|"


def csv_records(data: bytes, charset: str | None, delimiter: str | None = None) -> list[str]:
    """One paragraph per non-empty row: ``name: value; …`` under a header row, else the cells."""
    text = decode_text(data, charset)
    # A cell may hold a whole text (a product description, an article): as long as the upload.
    csv.field_size_limit(max(csv.field_size_limit(), len(text) + 1))
    try:
        delimiter = delimiter or _delimiter(text)
        rows = [
            [cell.strip() for cell in row]
            for row in csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=False)
        ]
    except csv.Error as exc:  # e.g. a NUL byte, or a field past csv's size limit
        raise InvalidArgument("data", f"not readable as CSV: {exc}") from None
    rows = [row for row in rows if any(row)]
    if not rows:
        return []
    header = rows[0] if len(rows) > 1 and _is_header(rows[0]) else None
    if header is None:
        return [", ".join(cell for cell in row if cell) for row in rows]
    records = []
    for row in rows[1:]:
        names = header + [f"column {i + 1}" for i in range(len(header), len(row))]
        pairs = [f"{name}: {cell}" for name, cell in zip(names, row, strict=False) if cell]
        if pairs:
            records.append("; ".join(pairs))
    return records or [", ".join(header)]


def _delimiter(text: str) -> str:
    """The separator that splits the first lines into the most rows of one width (``,`` if none).

    csv.Sniffer took a semicolon file with a blank line in it for one column of commas.
    """
    lines = [line for line in text[: 1 << 16].splitlines() if line.strip()][:20]
    best, best_score = ",", (0, 0)
    for candidate in _DELIMITERS:
        widths = [len(row) for row in csv.reader(lines, delimiter=candidate)]
        width = max(set(widths), key=widths.count) if widths else 0
        score = (widths.count(width), width) if width > 1 else (0, 0)
        if score > best_score:
            best, best_score = candidate, score
    return best


def _is_header(row: list[str]) -> bool:
    """Names, not data: every cell filled, no two alike, none a number."""
    return all(row) and len(set(row)) == len(row) and not any(_is_number(cell) for cell in row)


def _is_number(cell: str) -> bool:
    try:
        float(cell.replace(",", ""))
    except ValueError:
        return False
    return True


def json_sections(data: bytes, charset: str | None, lines: bool = False) -> list[tuple[str, list[str]]]:
    """(heading, paragraphs) of a JSON document (``lines``: JSON Lines, one value a line)."""
    text = decode_text(data, charset)
    try:
        values: Any = _json_lines(text) if lines else json.loads(text)
    except RecursionError:
        raise InvalidArgument("data", f"JSON nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:
        raise InvalidArgument("data", f"not valid JSON: {exc}") from None
    if isinstance(values, dict):
        # Scalars and lists of scalars describe the document: its first paragraph. A value holding
        # records (a list with objects) gets a section of them; any other object a section whose
        # lines keep their full path ("specs.power_watts"), so a chunk of it still says whose.
        head = {k: v for k, v in values.items() if not _holds_objects(v)}
        sections: list[tuple[str, list[str]]] = [("", [_record(head)])] if head else []
        for key, value in values.items():
            if isinstance(value, list) and _holds_objects(value):
                sections.append((str(key), _paragraphs(value)))
            elif isinstance(value, dict):
                sections.append((str(key), [_record({key: value})]))
        return sections
    return [("", _paragraphs(values))]


def _holds_objects(value: Any) -> bool:
    return isinstance(value, dict) or (
        isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value)
    )


def _json_lines(text: str) -> list[Any]:
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                values.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"line {number}: {exc}") from None
    return values


def _paragraphs(value: Any) -> list[str]:
    """A list: a paragraph per item (records); anything else: one paragraph."""
    items = value if isinstance(value, list) else [value]
    return [record for record in (_record(item) for item in items) if record]


def _record(value: Any) -> str:
    """``path: value`` lines; a list of scalars is one line (``colours: red, grey``)."""
    lines: dict[str, list[str]] = {}
    for line, text in _leaves(value):
        lines.setdefault(line, []).append(text)
    return "\n".join(
        f"{path}: {', '.join(texts)}" if path else ", ".join(texts) for path, texts in lines.items()
    )


def _leaves(value: Any) -> Iterator[tuple[str, str]]:
    """(line, text) of every non-empty scalar under ``value``, in document order.

    The line is the scalar's dotted path, except that a list's scalar items share their list's
    line: "a[0].b[1]" and "a[0].b[2]" are both on "a[0].b". Known by where the scalar sits, not
    by its path's text: a key may itself end in "]".
    """
    # (path, value, depth, the line of its list when it is a list's item)
    stack: list[tuple[str, Any, int, str | None]] = [("", value, 0, None)]
    while stack:
        path, item, depth, list_line = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidArgument("data", f"JSON nested more than {MAX_JSON_DEPTH} levels deep")
        children: list[tuple[str, Any, str | None]]
        if isinstance(item, dict):
            children = [(f"{path}.{k}" if path else str(k), v, None) for k, v in item.items()]
        elif isinstance(item, list):
            children = [(f"{path}[{i}]", v, path) for i, v in enumerate(item)]
        else:
            text = item if isinstance(item, str) else json.dumps(item)
            if text.strip():
                yield (path if list_line is None else list_line), text.strip()
            continue
        stack.extend((p, v, depth + 1, line) for p, v, line in reversed(children))
