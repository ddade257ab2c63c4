"""`llm-mesh ingest` planning: which files become which document ids, and why others are skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.retriever.ingest_cli import parse_metadata, plan


def test_folders_become_relative_ids_and_unsupported_files_are_skipped_with_a_reason(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "guides").mkdir(parents=True)
    (docs / "guides" / "setup.md").write_text("# Setup")
    (docs / "faq.html").write_text("<p>faq</p>")
    (docs / "logo.png").write_bytes(b"\x89PNG")
    (docs / ".git").mkdir()
    (docs / ".git" / "notes.txt").write_text("hidden")
    single = tmp_path / "single.txt"
    single.write_text("one file")

    planned, skipped = plan([docs, single, tmp_path / "missing"], id_prefix="kb/")

    assert [(p.document_id, p.path.name) for p in planned] == [
        ("kb/faq.html", "faq.html"),
        ("kb/guides/setup.md", "setup.md"),
        ("kb/single.txt", "single.txt"),
    ]
    assert [(Path(path).name, reason) for path, reason in skipped] == [
        ("logo.png", "unsupported type .png"),
        ("missing", "no such file or folder"),
    ]


def test_metadata_pairs_need_a_key_and_an_equals_sign() -> None:
    assert parse_metadata(["team=docs", "note=a=b"]) == {"team": "docs", "note": "a=b"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        parse_metadata(["no-equals"])
