"""Turns an uploaded document's bytes into text sections that remember their heading and page."""

from __future__ import annotations

import io
import logging
import re
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import PurePath
from typing import Any

from services.common.errors import InvalidArgument
from services.retriever import tabular
from services.retriever.pdf_layout import (
    PageText,
    PdfBlock,
    ReadingTooLong,
    layout_kept_the_text,
    page_lines,
    pdf_blocks,
)
from services.retriever.terms import normalized
from services.retriever.text_encoding import decode_text
from services.retriever.text_layout import (
    BOLD_HEADING_LEVEL,
    looks_like_title,
    markdown_bold_title,
    plain_text_blocks,
    setext_level,
)

log = logging.getLogger("llmmesh.retriever.parsing")

PLAIN_TEXT = "text/plain"
MARKDOWN = "text/markdown"
HTML = "text/html"
PDF = "application/pdf"
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"

# File extensions the CLI and the service recognise when no MIME type is given.
MIME_BY_EXTENSION: dict[str, str] = {
    ".txt": PLAIN_TEXT,
    ".text": PLAIN_TEXT,
    ".md": MARKDOWN,
    ".markdown": MARKDOWN,
    ".html": HTML,
    ".htm": HTML,
    ".pdf": PDF,
    ".docx": DOCX,
    ".csv": tabular.CSV,
    ".tsv": tabular.TSV,
    ".json": tabular.JSON,
    ".jsonl": tabular.JSON_LINES,
    ".ndjson": tabular.JSON_LINES,
}
# Aliases clients commonly send for the same formats.
_MIME_ALIASES = {
    "text/x-markdown": MARKDOWN,
    "application/xhtml+xml": HTML,
    "application/csv": tabular.CSV,
    "text/comma-separated-values": tabular.CSV,
    "text/json": tabular.JSON,
    "application/jsonl": tabular.JSON_LINES,
    "application/x-jsonlines": tabular.JSON_LINES,
    "application/jsonlines": tabular.JSON_LINES,
}

#: How long one document's text may take to read (``--max-parse-seconds``). Only PDFs get near
#: it: their content streams are compressed, so a few kilobytes can hold millions of text
#: runs (a 32 KB file took 57 s), where every other format's cost is bounded by its bytes.
DEFAULT_MAX_PARSE_SECONDS = 60.0

_MD_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_MD_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})(.*)$")
_DOCX_HEADING = re.compile(r"^(heading \d|title)$", re.IGNORECASE)


@dataclass(frozen=True)
class Section:
    """A run of text under one heading (and, for PDFs, on one page)."""

    text: str
    heading: str = ""
    page: int = 0
    #: The headings above it, outermost first, ending with ``heading``: what the section is about.
    path: tuple[str, ...] = ()


# Terminal escape sequences (CSI: colours, cursor moves) and the C0/C1 control characters but
# tab and line breaks: a document's NUL or ESC would otherwise reach prompts, search results
# and the terminal `llm-mesh ask --rag` prints citations to. Vertical tab and form feed (a page
# break in plain text) separate what they sit between, so they become line breaks; the other
# controls Python counts as whitespace (the separators \x1c-\x1f, NEL) become spaces, so no
# two words run together.
_CONTROLS = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _printable(text: str) -> str:
    return _CONTROLS.sub(_control_replacement, text)


def _control_replacement(match: re.Match[str]) -> str:
    control = match.group()
    if control in "\x0b\x0c":
        return "\n"
    return " " if control.isspace() else ""


def _printable_section(section: Section) -> Section:
    return replace(
        section,
        text=_printable(section.text),
        heading=_printable(section.heading),
        path=tuple(_printable(h) for h in section.path),
    )


class HeadingTrail:
    """The open headings while a document is read in order: a level-n heading closes those at n and deeper."""

    def __init__(self) -> None:
        self._open: list[tuple[int, str]] = []

    def enter(self, level: int, heading: str) -> None:
        while self._open and self._open[-1][0] >= level:
            self._open.pop()
        self._open.append((level, heading))

    def section(self, text: str) -> Section:
        path = tuple(h for _, h in self._open)
        return Section(text, path[-1] if path else "", path=path)


class SectionBuilder:
    """Sections from headings and paragraphs read in order, for every format.

    Paragraphs under one heading on one page make one section, blank-line
    separated. A heading with nothing under it (no text before a heading at its
    level or above, or the end) becomes a section of its own words, so no text
    of the document is lost.
    """

    def __init__(self) -> None:
        self._trail = HeadingTrail()
        self._sections: list[Section] = []
        self._paragraphs: list[str] = []
        self._page = 0
        # The last heading while nothing has been written under it.
        self._bare: tuple[int, str] | None = None

    def _close(self) -> None:
        if self._paragraphs:
            section = self._trail.section("\n\n".join(self._paragraphs))
            self._sections.append(replace(section, page=self._page))
            self._paragraphs = []

    def heading(self, level: int, text: str, page: int = 0) -> None:
        self._close()
        if self._bare is not None and level <= self._bare[0]:
            self._sections.append(replace(self._trail.section(self._bare[1]), page=self._page))
        self._trail.enter(level, text)
        self._bare, self._page = (level, text), page

    def paragraph(self, text: str, page: int = 0) -> None:
        if page != self._page:
            self._close()
            self._page = page
        self._paragraphs.append(text)
        self._bare = None

    def finish(self) -> list[Section]:
        self._close()
        if self._bare is not None:
            self._sections.append(replace(self._trail.section(self._bare[1]), page=self._page))
        return self._sections


def mime_type_for(path: str | PurePath) -> str | None:
    """The MIME type a file name implies, or None when the extension is unknown."""
    return MIME_BY_EXTENSION.get(PurePath(path).suffix.lower())


def normalize_mime_type(mime_type: str, source: str = "") -> str:
    """The supported MIME type meant by ``mime_type`` (or, when empty, by ``source``'s extension)."""
    raw = mime_type.split(";", 1)[0].strip().lower()
    if not raw and source:
        raw = mime_type_for(source) or ""
    raw = _MIME_ALIASES.get(raw, raw)
    if raw not in _PARSERS:
        supported = ", ".join(sorted(_PARSERS))
        shown = mime_type or "(empty)"
        raise InvalidArgument("header.mime_type", f"unsupported type {shown!r}; supported: {supported}")
    return raw


def base_type(mime_type: str) -> str:
    """``mime_type`` without its parameters (``text/plain; charset=…`` → ``text/plain``)."""
    return mime_type.split(";", 1)[0].strip()


def parse_document(
    data: bytes,
    mime_type: str,
    charset: str | None = None,
    max_seconds: float = DEFAULT_MAX_PARSE_SECONDS,
) -> list[Section]:
    """Sections of non-empty text; raises InvalidArgument for unreadable or empty documents.

    ``charset`` is the encoding the upload declared (``text_encoding.declared_charset``), for
    the text formats; a byte-order mark overrides it, as browsers do. A PDF still being read
    after ``max_seconds`` is refused (InvalidArgument) rather than holding a worker for as
    long as its pages ask.
    """
    if not data:
        raise InvalidArgument("data", "document is empty (0 bytes)")
    read = _parse_pdf(data, max_seconds) if mime_type == PDF else _PARSERS[mime_type](data, charset)
    parsed = (_printable_section(s) for s in read)
    # Only zero-width characters, soft hyphens or BOMs is no text a reader or a search could find.
    sections = [s for s in parsed if normalized(s.text).strip()]
    if not sections:
        # A PDF without a text layer is a scan: its pages are pictures of text.
        hint = "; a scanned PDF needs OCR (e.g. ocrmypdf) before it is ingested" if mime_type == PDF else ""
        raise InvalidArgument("data", f"document has no extractable text ({mime_type}){hint}")
    return sections


def _parse_plain(data: bytes, charset: str | None) -> list[Section]:
    builder = SectionBuilder()
    for block in plain_text_blocks(decode_text(data, charset)):
        if block.level:
            builder.heading(block.level, block.text)
        else:
            builder.paragraph(block.text)
    return builder.finish()


def _parse_markdown(data: bytes, charset: str | None) -> list[Section]:
    builder = SectionBuilder()
    lines: list[str] = []
    # The open code fence (``` or ~~~, three or more), or "" outside one.
    fence = ""
    in_fence = False
    source = decode_text(data, charset).splitlines()

    def flush() -> None:
        body = "\n".join(lines).strip()
        if body:
            builder.paragraph(body)
        lines.clear()

    def heading(level: int, text: str) -> None:
        flush()
        builder.heading(level, text)

    index = 0
    while index < len(source):
        line = source[index]
        fence_line = _MD_FENCE.match(line)
        if fence_line is not None:
            marker, rest = fence_line.groups()
            # CommonMark: a fence is closed only by the same character, at least as many, nothing after.
            opens = not fence and not (marker[0] == "`" and "`" in rest)
            if opens or (fence and marker.startswith(fence) and not rest.strip()):
                fence = "" if fence else marker
                lines.append(line)
                index += 1
                continue
        in_fence = bool(fence)
        after_blank = not (lines and lines[-1].strip())
        match = None if in_fence else _MD_HEADING.match(line)
        # A setext heading: a line after a blank one, underlined with === or --- (CommonMark).
        following = source[index + 1] if index + 1 < len(source) else ""
        underline = setext_level(following, line) if not in_fence and after_blank else 0
        # A line that is one bold phrase, on its own after a blank line: a heading shown in bold.
        bold = markdown_bold_title(line) if not in_fence and after_blank and not following.strip() else ""
        if match:
            heading(len(match.group(1)), match.group(2))
        elif underline:
            heading(underline, line.strip())
            index += 1
        elif bold:
            heading(BOLD_HEADING_LEVEL, bold)
        else:
            lines.append(line)
        index += 1
    flush()
    return builder.finish()


def _parse_html(data: bytes, charset: str | None) -> list[Section]:
    from bs4 import BeautifulSoup, UnicodeDammit

    # Without a declared charset: the BOM or <meta charset>, else detected, as BeautifulSoup
    # reads them. Decoded here, not by the parser, to drop the controls first, as every format's
    # text is (_printable): libxml2 refuses NUL and the other C0 controls in a tree. lxml, not Python's
    # html.parser, since that one rescans an unterminated comment or CDATA from its start on
    # every tag (100,000 "<!--" took 82 s, lxml 0.02 s).
    decoded = UnicodeDammit(data, [charset] if charset else [], is_html=True).unicode_markup
    if decoded is None:
        raise InvalidArgument("data", "HTML in no encoding that could be detected; declare its charset")
    soup = BeautifulSoup(_printable(decoded), "lxml")
    for tag in soup(["script", "style", "noscript", "template", "head"]):
        tag.decompose()
    reader = _HtmlReader()
    reader.walk(soup)
    return reader.finish()


# Elements a browser lays out as blocks: each starts a line. Every other element is inline and
# adds its text where it stands, so "H<sub>2</sub>O" stays one word, as a reader sees it.
_HTML_BLOCKS = frozenset(
    [
        "address",
        "article",
        "aside",
        "blockquote",
        "body",
        "caption",
        "center",
        "dd",
        "details",
        "dialog",
        "dir",
        "div",
        "dl",
        "dt",
        "fieldset",
        "figcaption",
        "figure",
        "footer",
        "form",
        "header",
        "hgroup",
        "hr",
        "html",
        "legend",
        "li",
        "main",
        "menu",
        "nav",
        "ol",
        "p",
        "section",
        "summary",
        "table",
        "tbody",
        "td",
        "tfoot",
        "th",
        "thead",
        "ul",
    ]
)
_HTML_HEADINGS = {f"h{level}": level for level in range(1, 7)}


class _HtmlReader:
    """An HTML tree as headings and lines of text, in document order, like a browser shows it.

    Every piece of text counts, wherever it sits (a bare ``<div>``, ``<section>`` or the
    body itself); ``<br>`` breaks a line; a table row is one line of its cells joined by
    `` | ``; ``<pre>`` keeps its lines. A heading's own text is the heading: blocks that an
    unclosed ``<h2>`` swallowed are body text under it, not part of its name.
    """

    def __init__(self) -> None:
        self._builder = SectionBuilder()
        self._lines: list[str] = []
        self._inline: list[str] = []

    def walk(self, root: Any) -> None:
        """Reads ``root``'s tree in document order. An explicit stack, not recursion: a page
        nested deeper than Python's stack (thousands of unclosed ``<div>``) is still a page."""
        from bs4 import NavigableString, Tag

        # Each frame: the children left to read, the heading level they are the name of (0: body
        # text), and what ends the element once they are read.
        stack: list[tuple[Iterator[Any], int, Callable[[], None] | None]] = [(iter(root.children), 0, None)]
        while stack:
            children, heading, end = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                if end is not None:
                    end()
                continue
            if isinstance(child, NavigableString):
                if type(child) is NavigableString:  # not a comment, doctype or processing instruction
                    self._inline.append(str(child))
                continue
            if not isinstance(child, Tag):
                continue
            name = child.name
            if name == "br":
                self._inline.append("\n")
            elif name in _HTML_HEADINGS:
                self._flush(heading)
                level = _HTML_HEADINGS[name]
                stack.append((iter(child.children), level, partial(self._flush, level)))
            elif name == "tr":
                self._flush(heading)
                cells = [_html_inline_text(c) for c in child.find_all(["td", "th"], recursive=False)]
                if any(cells):
                    self._lines.append(" | ".join(cells))
            elif name == "pre":
                self._flush(heading)
                self._lines.extend(line.rstrip() for line in child.get_text().splitlines() if line.strip())
            elif name in _HTML_BLOCKS:
                self._flush(heading)
                text = _html_inline_text(child) if name == "p" else ""
                if text and _html_bold_only(child) and looks_like_title(text):
                    self._heading(BOLD_HEADING_LEVEL, text)
                else:
                    # Blocks inside a heading are its body, not its name.
                    stack.append((iter(child.children), 0, self._flush))
            else:
                stack.append((iter(child.children), heading, None))

    def _flush(self, heading: int = 0) -> None:
        """Ends the text collected since the last block boundary: a heading, or lines of body text."""
        lines = [" ".join(line.split()) for line in "".join(self._inline).split("\n")]
        self._inline.clear()
        lines = [line for line in lines if line]
        if heading and lines:
            self._heading(heading, " ".join(lines))
        else:
            self._lines.extend(lines)

    def _heading(self, level: int, text: str) -> None:
        if self._lines:
            self._builder.paragraph("\n".join(self._lines))
            self._lines = []
        self._builder.heading(level, text)

    def finish(self) -> list[Section]:
        self._flush()
        if self._lines:
            self._builder.paragraph("\n".join(self._lines))
        return self._builder.finish()


def _html_inline_text(element: Any) -> str:
    """An element's text on one line, as shown: inline tags add nothing between words, blocks a space."""
    from bs4 import NavigableString, Tag

    parts: list[str] = []
    for piece in element.descendants:
        if isinstance(piece, Tag) and (piece.name in _HTML_BLOCKS or piece.name == "br"):
            parts.append(" ")
        elif type(piece) is NavigableString:
            parts.append(str(piece))
    return " ".join("".join(parts).split())


def _html_bold_only(element: Any) -> bool:
    """Whether all of a block's text sits inside <strong> or <b>: a heading shown in bold."""
    bold = "".join(
        b.get_text() for b in element.find_all(["strong", "b"]) if b.find_parent(["strong", "b"]) is None
    )
    return bool(bold.strip()) and " ".join(bold.split()) == " ".join(element.get_text().split())


def _parse_pdf(data: bytes, max_seconds: float = DEFAULT_MAX_PARSE_SECONDS) -> list[Section]:
    from pypdf import PasswordType, PdfReader
    from pypdf.errors import PyPdfError

    deadline = time.monotonic() + max_seconds
    pages: list[PageText] = []
    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        # Most "encrypted" PDFs only restrict printing or copying (an owner password): every
        # viewer opens them with the empty user password, and so does this.
        if reader.is_encrypted and reader.decrypt("") == PasswordType.NOT_DECRYPTED:
            raise InvalidArgument("data", "PDF is encrypted: it needs a password to open")
        for page in reader.pages:
            if time.monotonic() > deadline:
                raise ReadingTooLong
            pages.append(page_lines(page, deadline))
    except InvalidArgument:
        raise
    except ReadingTooLong:
        raise InvalidArgument(
            "data",
            f"PDF took longer than {max_seconds:g} s to read ({len(pages)} of {_page_count(reader)} "
            "pages read): split it, or raise the retriever's --max-parse-seconds",
        ) from None
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
        # pypdf reports damage through many exception types; all of them mean the same to a client.
        raise InvalidArgument("data", f"not a readable PDF: {exc}") from exc
    try:
        if layout_kept_the_text(pages):
            return _pdf_sections(pdf_blocks([page.lines for page in pages]))
        log.info("PDF layout lost text; reading its pages as plain text")
    except Exception:  # the layout is a refinement: a PDF it cannot read is still ingested
        log.warning("PDF layout analysis failed; reading its pages as plain text", exc_info=True)
    return [Section(page.text.strip(), page=number) for number, page in enumerate(pages, start=1)]


def _page_count(reader: Any) -> str:
    try:
        return str(len(reader.pages))
    except Exception:  # a damaged page tree: the count is only for the message
        return "?"


def _pdf_sections(blocks: list[PdfBlock]) -> list[Section]:
    """Sections from a PDF's headings and paragraphs: one per heading per page."""
    builder = SectionBuilder()
    for block in blocks:
        if block.level:
            builder.heading(block.level, block.text, block.page)
        else:
            builder.paragraph(block.text, block.page)
    return builder.finish()


def _parse_docx(data: bytes) -> list[Section]:
    document = _open_docx(data)
    paragraphs = document.paragraphs
    rows = [row for table in document.tables for row in table.rows]
    if len(paragraphs) + len(rows) > DOCX_MAX_BLOCKS:
        raise InvalidArgument(
            "data",
            f"the DOCX has {len(paragraphs) + len(rows):,} paragraphs and table rows, more than the "
            f"{DOCX_MAX_BLOCKS:,} accepted (split the document)",
        )
    styles = _DocxStyles()
    builder = SectionBuilder()
    lines: list[str] = []
    for paragraph in paragraphs:
        text = paragraph.text.strip()
        if not text:
            continue
        style = styles.paragraph_style(paragraph)
        level = -1
        if _DOCX_HEADING.match(style):
            # "Title" is the outermost level; "Heading N" nests under it.
            level = int(style.split()[-1]) if style.lower().startswith("heading") else 0
        elif styles.bold_only(paragraph) and looks_like_title(text):
            level = BOLD_HEADING_LEVEL  # a heading typed as a bold line, not given a heading style
        if level >= 0:
            if lines:
                builder.paragraph("\n".join(lines))
            builder.heading(level, text)
            lines = []
        else:
            lines.append(text)
    for row in rows:
        lines.append(" | ".join(cell.text.strip() for cell in row.cells))
    if lines:
        builder.paragraph("\n".join(lines))
    return builder.finish()


#: What a DOCX may unzip to: python-docx holds every part in memory, and its XML as a tree
#: several times its size, while 20 MB of zipped XML can claim gigabytes (a zip bomb). A
#: 1,000-page text document is ≈ 30 MB unzipped.
DOCX_MAX_EXPANDED_BYTES = 256 * 1024 * 1024
#: Paragraphs and table rows read from one DOCX (≈ 10,000 pages): ≈ 40 µs each, so a document
#: of empty paragraphs, which zips to almost nothing, cannot hold the retriever for minutes.
DOCX_MAX_BLOCKS = 500_000


def _open_docx(data: bytes) -> Any:
    """The python-docx ``Document``; ``InvalidArgument`` for what is not one or would not fit."""
    import zipfile

    from docx import Document
    from docx.opc.exceptions import PackageNotFoundError
    from lxml import etree

    damaged = (
        PackageNotFoundError,
        zipfile.BadZipFile,
        KeyError,
        ValueError,
        # A part that is not XML, or one libxml2 refuses (nested past its depth limit, entities
        # that expand past its amplification limit: the "billion laughs").
        etree.LxmlError,
        zlib.error,  # a damaged deflate stream
        EOFError,  # a part cut short
        NotImplementedError,  # a zip version or compression method zipfile lacks
        RuntimeError,  # an encrypted part
    )
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            # The archive's own claims: zipfile never unzips past a part's claimed size (its
            # CRC fails if the data ran longer), so they bound what python-docx will unzip.
            expanded = sum(info.file_size for info in archive.infolist())
    except damaged as exc:
        raise InvalidArgument("data", f"not a readable DOCX file: {exc}") from exc
    if expanded > DOCX_MAX_EXPANDED_BYTES:
        raise InvalidArgument(
            "data",
            f"the DOCX unzips to {expanded / 2**20:,.0f} MiB, more than the "
            f"{DOCX_MAX_EXPANDED_BYTES / 2**20:.0f} MiB accepted (a zip bomb, or split the document)",
        )
    try:
        return Document(io.BytesIO(data))
    except damaged as exc:
        raise InvalidArgument("data", f"not a readable DOCX file: {exc}") from exc


class _DocxStyles:
    """Style lookups, once per style id: python-docx resolves a paragraph's or run's style by
    searching every style of the document each time (≈ 30 µs), twice the cost of the rest of a
    paragraph. ``_p``/``_r`` are its XML elements, where the style id is one attribute."""

    def __init__(self) -> None:
        self._paragraph: dict[str | None, str] = {}
        self._run_bold: dict[str | None, bool] = {}

    def paragraph_style(self, paragraph: Any) -> str:
        """The paragraph's style name ("Heading 2", "Title", "Normal"; "" when it has none)."""
        key = paragraph._p.style
        if key not in self._paragraph:
            style = paragraph.style
            self._paragraph[key] = style.name if style is not None and style.name else ""
        return self._paragraph[key]

    def bold_only(self, paragraph: Any) -> bool:
        """Whether every run of a paragraph that has text is bold (directly or by its character style)."""
        runs = [run for run in paragraph.runs if run.text.strip()]
        return bool(runs) and all(run.bold or self._style_bold(run) for run in runs)

    def _style_bold(self, run: Any) -> bool:
        key = run._r.style
        if key not in self._run_bold:
            style = run.style
            self._run_bold[key] = bool(style is not None and style.font.bold)
        return self._run_bold[key]


def _parse_csv(data: bytes, charset: str | None, delimiter: str | None = None) -> list[Section]:
    # One section of records, a paragraph each: the chunker packs them into chunks, never splitting one.
    records = tabular.csv_records(data, charset, delimiter)
    return [Section("\n\n".join(records))] if records else []


def _parse_json(data: bytes, charset: str | None, lines: bool = False) -> list[Section]:
    return [
        Section("\n\n".join(records), heading, path=(heading,) if heading else ())
        for heading, records in tabular.json_sections(data, charset, lines)
        if records
    ]


# Each takes the bytes and the declared charset; PDF and DOCX say their own encodings.
_PARSERS: dict[str, Callable[[bytes, str | None], list[Section]]] = {
    PLAIN_TEXT: _parse_plain,
    MARKDOWN: _parse_markdown,
    HTML: _parse_html,
    PDF: lambda data, _charset: _parse_pdf(data),  # parse_document passes its deadline
    DOCX: lambda data, _charset: _parse_docx(data),
    tabular.CSV: _parse_csv,
    tabular.TSV: lambda data, charset: _parse_csv(data, charset, "\t"),
    tabular.JSON: _parse_json,
    tabular.JSON_LINES: lambda data, charset: _parse_json(data, charset, lines=True),
}
