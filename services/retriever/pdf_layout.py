"""Headings and paragraphs of a text PDF, from its fonts and line positions.

A PDF has no markup: ``extract_text`` gives wrapped lines and nothing else, so
every line would be its own "paragraph" and chunks would start mid-sentence
under no heading. What a reader sees is still there: headings are set larger
or bold, and paragraphs are separated by more space than lines are. pypdf
reports each text run with its font, size and position (``visitor_text``);
this module groups runs into lines, finds the body text's style (the one with
the most characters), takes lines set larger or bolder than it as headings,
and breaks paragraphs where the gap between lines is wider than usual, the
way layout-aware PDF readers do.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Sizes closer than this (points) are one style.
_SIZE_QUANTUM = 0.5
# A line this much larger than body text is a heading.
_HEADING_SCALE = 1.15
# A gap this much wider than the usual line gap separates paragraphs.
_PARAGRAPH_GAP = 1.4
# Longer than this, a line in a heading's style is emphasised body text.
_HEADING_MAX_CHARS = 120
_BOLD_MARKERS = ("bold", "black", "heavy", "semibold", "demi")


class ReadingTooLong(Exception):
    """A page's text runs went on past the reading deadline (``page_lines``'s ``deadline``)."""


@dataclass
class PdfLine:
    text: str
    #: Vertical position on the page (larger is higher); None when the run did not say.
    y: float | None
    size: float
    bold: bool
    #: Ended by a newline: the next run starts a new line even at the same height.
    closed: bool = False


@dataclass(frozen=True)
class PdfBlock:
    """A heading (``level`` ≥ 1) or a paragraph (``level`` 0) on a page."""

    page: int
    level: int
    text: str


def _is_bold(font: Any) -> bool:
    try:
        name = str(font.get("/BaseFont", "")) if hasattr(font, "get") else ""
    except Exception:  # a damaged font dictionary only costs the bold hint
        return False
    return any(marker in name.lower() for marker in _BOLD_MARKERS)


@dataclass(frozen=True)
class PageText:
    """One page: its styled lines, and pypdf's plain text of it (the fallback)."""

    lines: list[PdfLine]
    text: str


def _position(cm: Sequence[float], tm: Sequence[float], size: float) -> tuple[float | None, float]:
    """A run's height on the page and its size in points; (None, 0) when the matrices are unusable."""
    try:
        scale = abs(float(tm[3]) * float(cm[3])) or 1.0
        y = float(tm[4]) * float(cm[1]) + float(tm[5]) * float(cm[3]) + float(cm[5])
        height = round(float(size) * scale / _SIZE_QUANTUM) * _SIZE_QUANTUM
    except (TypeError, ValueError, IndexError, OverflowError):
        return None, 0.0
    if not (math.isfinite(y) and math.isfinite(height)):
        return None, 0.0
    return y, height


def page_lines(page: Any, deadline: float = math.inf) -> PageText:
    """The page's text lines with their style and position, in reading order (pypdf's).

    ``deadline`` (``time.monotonic()``): past it, ``ReadingTooLong``. A few kilobytes of
    compressed content can hold millions of text runs, and one page's runs, or the form
    XObjects it draws over and over, can take minutes: the check runs per run, not per page.
    """
    lines: list[PdfLine] = []

    def visit(text: str, cm: Sequence[float], tm: Sequence[float], font: Any, size: float) -> None:
        if time.monotonic() > deadline:
            raise ReadingTooLong
        if not text:
            return
        # Never raise below: an exception would lose the page's text, not just its layout.
        y, height = _position(cm, tm, size)
        bold = _is_bold(font)
        pieces = text.split("\n")
        for number, piece in enumerate(pieces):
            current = lines[-1] if lines else None
            if (
                number == 0
                and current is not None
                and not current.closed
                and current.y is not None
                and y is not None
                and abs(current.y - y) < max(height, 1.0) * 0.5
            ):
                current.text += piece
                # Bold only if every run is: a bold word inside body text does not make a heading.
                current.bold = current.bold and (bold or not piece.strip())
            elif piece.strip() or number == 0:
                # Lines after a newline inside one run have no position of their own.
                lines.append(PdfLine(piece, y if number == 0 else None, height, bold))
            if number < len(pieces) - 1 and lines:
                lines[-1].closed = True

    text = page.extract_text(visitor_text=visit) or ""
    out = []
    for line in lines:
        line.text = " ".join(line.text.split())
        if line.text:
            out.append(line)
    return PageText(out, text)


def layout_kept_the_text(pages: Sequence[PageText]) -> bool:
    """Whether the styled lines hold the words of pypdf's plain text (else use that text as it is)."""
    plain = sum(len(page.text.split()) for page in pages)
    styled = sum(len(line.text.split()) for page in pages for line in page.lines)
    return styled >= plain * 0.98


def pdf_blocks(pages: Sequence[Sequence[PdfLine]]) -> list[PdfBlock]:
    """Headings and paragraphs of the whole document (``pages[i]`` is page i + 1)."""
    chars: Counter[tuple[float, bool]] = Counter()
    for lines in pages:
        for line in lines:
            chars[(line.size, line.bold)] += len(line.text)
    if not chars:
        return []
    body_size, body_bold = chars.most_common(1)[0][0]
    heading_sizes = sorted({line.size for lines in pages for line in lines if _larger(line.size, body_size)})

    def level(line: PdfLine) -> int:
        if len(line.text) > _HEADING_MAX_CHARS or line.text.endswith((".", ",", ";")):
            return 0
        if _larger(line.size, body_size):
            return len(heading_sizes) - heading_sizes.index(line.size)
        if line.bold and not body_bold and abs(line.size - body_size) <= _SIZE_QUANTUM:
            return len(heading_sizes) + 1
        return 0

    blocks: list[PdfBlock] = []
    for number, lines in enumerate(pages, start=1):
        gaps = [
            a.y - b.y
            for a, b in itertools.pairwise(lines)
            if a.y is not None and b.y is not None and a.y > b.y and not level(a) and not level(b)
        ]
        usual = statistics.median(gaps) if gaps else 0.0
        paragraph: list[str] = []
        previous: PdfLine | None = None
        for line in lines:
            heading = level(line)
            wide_gap = (
                previous is not None
                and previous.y is not None
                and line.y is not None
                and usual > 0
                and previous.y - line.y > usual * _PARAGRAPH_GAP
            )
            if (heading or wide_gap) and paragraph:
                blocks.append(PdfBlock(number, 0, "\n".join(paragraph)))
                paragraph = []
            if heading:
                last = blocks[-1] if blocks else None
                # A heading wrapped onto two lines is one heading.
                if (
                    last is not None
                    and last.level == heading
                    and last.page == number
                    and previous is not None
                    and level(previous) == heading
                ):
                    blocks[-1] = PdfBlock(number, heading, f"{last.text} {line.text}")
                else:
                    blocks.append(PdfBlock(number, heading, line.text))
            else:
                paragraph.append(line.text)
            previous = line
        if paragraph:
            blocks.append(PdfBlock(number, 0, "\n".join(paragraph)))
    if blocks and blocks[0].level:
        # A heading before any text is the document's title: every other heading sits under it.
        blocks = blocks[:1] + [PdfBlock(b.page, b.level + 1 if b.level else 0, b.text) for b in blocks[1:]]
    return blocks


def _larger(size: float, body_size: float) -> bool:
    return size >= body_size * _HEADING_SCALE
