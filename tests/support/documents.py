"""Builds test documents: a text PDF written by hand, DOCX files, and the shipped retriever corpus."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parents[1] / "data" / "corpus"
# Files in CORPUS_DIR that describe a document to generate rather than being one.
_SPEC_SUFFIXES = (".pdf.json", ".docx.json")


def _pdf_string(text: str) -> str:
    return "(" + text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)") + ")"


def text_pdf(pages: Sequence[Sequence[str]], title: str = "") -> bytes:
    """A valid PDF with one Helvetica text line per string, one page per list.

    A line starting with ``"# "`` is set as a heading, 14 pt Helvetica-Bold, as a
    word processor sets one; an empty string is an empty line (a paragraph gap).
    pypdf reads text but cannot write it, and reportlab is not a dependency, so
    the few objects a text PDF needs are written out directly.
    """
    objects: list[bytes] = []
    page_ids = [4 + 2 * i for i in range(len(pages))]
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    kids = " ".join(f"{pid} 0 R" for pid in page_ids)
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {len(pages)} >>".encode())
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>")
    for pid, lines in zip(page_ids, pages, strict=True):
        body = ["BT", "/F1 11 Tf", "14 TL", "50 760 Td"]
        for line in lines:
            if line.startswith("# "):
                body.append(f"/F2 14 Tf {_pdf_string(line[2:])} Tj T* /F1 11 Tf")
            else:
                body.append(f"{_pdf_string(line)} Tj T*" if line else "T*")
        body.append("ET")
        stream = "\n".join(body).encode("latin-1")
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R "
            f"/F2 {len(page_ids) * 2 + 4} 0 R >> >> /Contents {pid + 1} 0 R >>".encode()
        )
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica-Bold /Encoding /WinAnsiEncoding >>")
    info_id = len(objects) + 1
    objects.append(f"<< /Title {_pdf_string(title)} >>".encode("latin-1"))
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, obj in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(f"{number} 0 obj\n".encode() + obj + b"\nendobj\n")
    xref = out.tell()
    out.write(f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode())
    for offset in offsets:
        out.write(f"{offset:010d} 00000 n \n".encode())
    out.write(
        f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R /Info {info_id} 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    )
    return out.getvalue()


def docx_document(paragraphs: Sequence[tuple[str, str]]) -> bytes:
    """A DOCX with ``(style, text)`` paragraphs; styles like "Heading 1" become chunk headings.

    The style ``"bold"`` is a Normal paragraph whose one run is bold: a heading typed as a
    bold line, as many documents have instead of a heading style.
    """
    from docx import Document

    document = Document()
    for style, text in paragraphs:
        if style == "bold":
            document.add_paragraph().add_run(text).bold = True
        else:
            document.add_paragraph(text, style=style)
    buffer = io.BytesIO()
    document.save(buffer)
    return buffer.getvalue()


def build_corpus(dest: Path) -> Path:
    """Writes the test corpus (text files copied, PDF and DOCX generated) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(CORPUS_DIR.iterdir()):
        if path.name == "questions.json":
            continue
        if path.name.endswith(".pdf.json"):
            spec = json.loads(path.read_text())
            (dest / path.name.removesuffix(".json")).write_bytes(text_pdf(spec["pages"], spec["title"]))
        elif path.name.endswith(".docx.json"):
            spec = json.loads(path.read_text())
            pairs = [(style, text) for style, text in spec["paragraphs"]]
            (dest / path.name.removesuffix(".json")).write_bytes(docx_document(pairs))
        elif not path.name.endswith(_SPEC_SUFFIXES):
            shutil.copy(path, dest / path.name)
    return dest


def corpus_questions() -> list[tuple[str, str]]:
    """``(question, file name of the document that answers it)`` pairs written for the corpus."""
    return [(q["question"], q["document"]) for q in json.loads((CORPUS_DIR / "questions.json").read_text())]


def content_stream_pdf(stream: bytes, pages: int = 1, compress: bool = False) -> bytes:
    """A PDF of ``pages`` pages, each drawing ``stream`` (PDF content operators) with /F1 Helvetica
    and /F2 Helvetica-Bold; ``compress``: the content Flate-compressed, as PDF writers store it."""
    from pypdf import PdfWriter
    from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject

    writer = PdfWriter()
    fonts = DictionaryObject()
    for name, base in (("/F1", "/Helvetica"), ("/F2", "/Helvetica-Bold")):
        font = DictionaryObject(
            {
                NameObject("/Type"): NameObject("/Font"),
                NameObject("/Subtype"): NameObject("/Type1"),
                NameObject("/BaseFont"): NameObject(base),
            }
        )
        fonts[NameObject(name)] = writer._add_object(font)
    for _ in range(pages):
        page = writer.add_blank_page(612, 792)
        page[NameObject("/Resources")] = DictionaryObject({NameObject("/Font"): fonts})
        contents = DecodedStreamObject()
        contents.set_data(stream)
        page[NameObject("/Contents")] = writer._add_object(contents)
        if compress:
            page.compress_content_streams()
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()
