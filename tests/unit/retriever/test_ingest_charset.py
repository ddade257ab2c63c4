"""`llm-mesh ingest --charset` declares the encoding of every text format, JSON included."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.client.ingest import document_mime_type


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("notes.txt", "text/plain; charset=windows-1252"),
        ("menu.json", "application/json; charset=windows-1252"),
        ("menu.jsonl", "application/x-ndjson; charset=windows-1252"),
        ("menu.csv", "text/csv; charset=windows-1252"),
        # PDF and DOCX say their own encodings.
        ("report.pdf", "application/pdf"),
        ("report.docx", "application/vnd.openxmlformats-officedocument.wordprocessingml.document"),
    ],
)
def test_the_charset_goes_with_every_text_format(name: str, expected: str) -> None:
    # Only text/* got it: a Windows-1252 .json file was sent as UTF-8 and refused.
    assert document_mime_type(Path(name), "windows-1252") == expected
    assert document_mime_type(Path(name), None) == expected.split(";")[0]
