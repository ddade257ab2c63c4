"""The retrieval evaluation set (bench/data/retrieval/) and the scores reported over it.

    from bench.retrieval_eval import load_eval_set, recall_at, reciprocal_rank, summarize
    eval_set = load_eval_set(neutral_ids=True)

Fictional documents in five formats, with look-alike pairs ("twins": two
documents on the same kind of invented thing that differ in the facts), and
questions of four kinds, each with its gold document ids. The set is for
benchmarks only: tests of the retriever use their own fixtures
(tests/data/corpus/), so tuning against one never overfits the other.

Markdown, text and HTML documents are stored as the files a user would upload.
PDF and DOCX documents are stored as Markdown sources and built here, at load
time, byte-for-byte the same on every run (see bench/data/retrieval/README.md).

With ``neutral_ids`` every document id, title and file name is ``doc-NNN``
(numbered in a seeded shuffle, so twins are not neighbours): nothing but the
text itself tells the twins apart.
"""

from __future__ import annotations

import io
import json
import random
import textwrap
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from services.retriever.parsing import DOCX, PDF, mime_type_for

DATA_DIR = Path(__file__).resolve().parent / "data" / "retrieval"
KINDS = ("paraphrased", "confusable", "multi_section", "lexical")
ALL_KINDS = "all"
DEFAULT_KS = (1, 3, 5)
# Fixed so that the neutral numbering is the same in every run and on every machine.
_NEUTRAL_SEED = 27
# A DOCX is a zip: its members' timestamps are pinned so that a rebuild gives the same bytes.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class EvalDocument:
    document_id: str
    title: str
    filename: str
    mime_type: str
    data: bytes
    # The id of this document's look-alike, "" for a document without one.
    twin: str = ""


@dataclass(frozen=True)
class EvalQuestion:
    text: str
    gold_document_ids: list[str]
    kind: str


@dataclass(frozen=True)
class EvalSet:
    documents: list[EvalDocument]
    questions: list[EvalQuestion]


@dataclass(frozen=True)
class KindScore:
    """Mean scores of one kind of question (or of all of them)."""

    questions: int
    recall: dict[int, float]
    mrr: float


def load_eval_set(neutral_ids: bool = False, data_dir: Path = DATA_DIR) -> EvalSet:
    """The documents (with their bytes built) and the questions, ids mapped when ``neutral_ids``."""
    manifest = json.loads((data_dir / "documents.json").read_text())
    names = {entry["id"]: entry["id"] for entry in manifest}
    if neutral_ids:
        names = neutral_names([entry["id"] for entry in manifest])
    documents = []
    for entry in manifest:
        filename: str = entry["file"]
        mime_type = mime_type_for(filename)
        if mime_type is None:
            raise ValueError(f"{filename}: not a format the retriever parses")
        document_id = names[entry["id"]]
        suffix = Path(filename).suffix
        documents.append(
            EvalDocument(
                document_id=document_id,
                title=document_id if neutral_ids else entry["title"],
                filename=f"{document_id}{suffix}" if neutral_ids else filename,
                mime_type=mime_type,
                data=_document_bytes(data_dir, filename, mime_type),
                twin=names[entry["twin"]] if entry.get("twin") else "",
            )
        )
    questions = []
    for line in (data_dir / "questions.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            questions.append(EvalQuestion(row["question"], [names[g] for g in row["gold"]], row["kind"]))
    return EvalSet(documents, questions)


def neutral_names(document_ids: Sequence[str]) -> dict[str, str]:
    """``doc-001``… assigned in a seeded shuffle of the sorted ids."""
    shuffled = sorted(document_ids)
    random.Random(_NEUTRAL_SEED).shuffle(shuffled)
    return {original: f"doc-{number:03d}" for number, original in enumerate(shuffled, start=1)}


def _document_bytes(data_dir: Path, filename: str, mime_type: str) -> bytes:
    if mime_type == PDF:
        return build_pdf((data_dir / "sources" / f"{filename}.md").read_text())
    if mime_type == DOCX:
        return build_docx((data_dir / "sources" / f"{filename}.md").read_text())
    return (data_dir / "documents" / filename).read_bytes()


def markdown_blocks(source: str) -> list[tuple[int, str]]:
    """``(heading level, text)`` blocks of a source: level 0 is a paragraph, 1-3 are ``#``-``###``."""
    blocks: list[tuple[int, str]] = []
    for block in source.strip().split("\n\n"):
        text = " ".join(block.split())
        level = len(text) - len(text.lstrip("#"))
        if 1 <= level <= 3 and text[level : level + 1] == " ":
            blocks.append((level, text[level + 1 :]))
        elif text:
            blocks.append((0, text))
    return blocks


@cache  # the same bytes every time: a bench that loads both id modes builds each file once
def build_docx(source: str) -> bytes:
    """A DOCX whose ``#`` headings carry Word's Title / Heading styles, as an office suite writes them."""
    from docx import Document

    document = Document()
    # Looked up once: python-docx resolves a style given by name on every paragraph, slowly.
    styles = {1: document.styles["Title"], 2: document.styles["Heading 1"], 3: document.styles["Heading 2"]}
    for level, text in markdown_blocks(source):
        document.add_paragraph(text, style=styles.get(level))
    buffer = io.BytesIO()
    document.save(buffer)
    return _pinned_zip(buffer.getvalue())


def _pinned_zip(data: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w") as dest:
        for info in source.infolist():
            pinned = zipfile.ZipInfo(info.filename, _ZIP_EPOCH)
            pinned.compress_type = zipfile.ZIP_DEFLATED
            dest.writestr(pinned, source.read(info))
    return out.getvalue()


# A US Letter page in points, 11 pt Helvetica: ~90 characters a line, ~48 lines a page.
_PAGE_WIDTH, _PAGE_HEIGHT, _MARGIN, _LEADING, _LINE_CHARS = 612, 792, 56, 14, 90
_LINES_PER_PAGE = (_PAGE_HEIGHT - 2 * _MARGIN) // _LEADING


@cache
def build_pdf(source: str) -> bytes:
    """A text PDF (Helvetica, headings in bold), wrapped and paginated like a word processor's export.

    pypdf writes the file structure (objects, cross-reference table); it has no
    text layout, so the page content streams (a few text operators per line)
    are written here. reportlab would do both but is not a dependency.
    """
    from pypdf import PdfWriter
    from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject

    lines: list[tuple[str, str]] = []  # (font, text); ("", "") is a blank line
    for level, text in markdown_blocks(source):
        font = "/F2" if level else "/F1"
        wrapped = textwrap.wrap(text, _LINE_CHARS, break_on_hyphens=False)  # "sodium-ion" stays whole
        lines += [(font, part) for part in wrapped] + [("", "")]
    writer = PdfWriter()
    fonts = DictionaryObject(
        {
            NameObject(name): writer._add_object(
                DictionaryObject(
                    {
                        NameObject("/Type"): NameObject("/Font"),
                        NameObject("/Subtype"): NameObject("/Type1"),
                        NameObject("/BaseFont"): NameObject(base),
                        NameObject("/Encoding"): NameObject("/WinAnsiEncoding"),
                    }
                )
            )
            for name, base in (("/F1", "/Helvetica"), ("/F2", "/Helvetica-Bold"))
        }
    )
    for start in range(0, len(lines), _LINES_PER_PAGE):
        ops = ["BT", f"{_LEADING} TL", f"{_MARGIN} {_PAGE_HEIGHT - _MARGIN} Td"]
        for font, text in lines[start : start + _LINES_PER_PAGE]:
            ops.append(f"{font} 11 Tf {_pdf_string(text)} Tj T*" if text else "T*")
        ops.append("ET")
        page = writer.add_blank_page(_PAGE_WIDTH, _PAGE_HEIGHT)
        stream = DecodedStreamObject()
        stream.set_data("\n".join(ops).encode("cp1252"))
        page[NameObject("/Contents")] = writer._add_object(stream)
        page[NameObject("/Resources")] = DictionaryObject({NameObject("/Font"): fonts})
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


def _pdf_string(text: str) -> str:
    return "(" + text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)") + ")"


def distinct(ranked_document_ids: Iterable[str]) -> list[str]:
    """Document ids in rank order, each once: several chunks of one document count as one result."""
    return list(dict.fromkeys(ranked_document_ids))


def recall_at(ranked_document_ids: Sequence[str], gold: Sequence[str], k: int) -> float:
    """Share of the gold documents among the first ``k`` distinct documents ranked."""
    top = set(distinct(ranked_document_ids)[:k])
    return sum(1 for g in set(gold) if g in top) / len(set(gold))


def reciprocal_rank(ranked_document_ids: Sequence[str], gold: Sequence[str]) -> float:
    """1 / the rank of the first gold document among the distinct documents ranked; 0 if none is."""
    for rank, document_id in enumerate(distinct(ranked_document_ids), start=1):
        if document_id in gold:
            return 1.0 / rank
    return 0.0


def summarize(
    results: Sequence[tuple[EvalQuestion, Sequence[str]]], ks: Sequence[int] = DEFAULT_KS
) -> dict[str, KindScore]:
    """Mean recall@k and MRR per question kind (in ``KINDS`` order) and over all questions."""
    groups: dict[str, list[tuple[EvalQuestion, Sequence[str]]]] = {}
    for question, ranked in results:
        groups.setdefault(question.kind, []).append((question, ranked))
    groups[ALL_KINDS] = list(results)
    summary = {}
    for kind in [*KINDS, *sorted(set(groups) - set(KINDS) - {ALL_KINDS}), ALL_KINDS]:
        rows = groups.get(kind, [])
        if not rows:
            continue
        summary[kind] = KindScore(
            questions=len(rows),
            recall={
                k: round(sum(recall_at(r, q.gold_document_ids, k) for q, r in rows) / len(rows), 4)
                for k in ks
            },
            mrr=round(sum(reciprocal_rank(r, q.gold_document_ids) for q, r in rows) / len(rows), 4),
        )
    return summary


def format_summary(summary: dict[str, KindScore]) -> str:
    """A fixed-width table: one row per kind, recall@k columns and MRR."""
    ks = sorted(next(iter(summary.values())).recall) if summary else []
    header = f"{'kind':<14}{'n':>5}" + "".join(f"{'R@' + str(k):>8}" for k in ks) + f"{'MRR':>8}"
    rows = [
        f"{kind:<14}{score.questions:>5}"
        + "".join(f"{score.recall[k]:>8.3f}" for k in ks)
        + f"{score.mrr:>8.3f}"
        for kind, score in summary.items()
    ]
    return "\n".join([header, *rows])
