"""Headings in plain text: setext underlines and short title lines standing alone.

A ``.txt`` file has no markup, but its headings are usually plain to a reader:
a line underlined with ``===`` or ``---`` (the convention Markdown took its
setext headings from), or a short line on its own between blank lines that
does not end like a sentence. Finding them lets a chunk keep its heading path
("Quality control" under "Cooperativa Río Tendal") and lets chunk boundaries
follow sections, as they do for Markdown, HTML and DOCX.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A whole line in bold, Markdown's way: **Title** or __Title__.
_MD_BOLD_LINE = re.compile(r"^\s{0,3}(\*\*|__)(?P<text>[^*_].*?)\1\s*$")
#: The level of a heading only shown in bold (a bold-only line, paragraph or HTML block): deeper
#: than any real heading level (Markdown and HTML stop at 6, DOCX at 9), so it nests under them.
BOLD_HEADING_LEVEL = 10

# An underline of at least three '=' (level 1) or '-' (level 2) and nothing else.
_SETEXT = re.compile(r"^\s{0,3}(=+|-+)\s*$")
# A title line ends without sentence punctuation; a sentence or a list item ends with one of these
# (the full-width forms are Chinese and Japanese, the others Arabic and Urdu).
_SENTENCE_END = tuple(".,;:!?" + "。，；：！？、．" + "؟،؛۔")
# Longer than this, a lone line is a one-line paragraph rather than a heading.
_TITLE_MAX_CHARS = 80
_TITLE_MAX_WORDS = 10


@dataclass(frozen=True)
class TextBlock:
    """A heading (``level`` 1 or 2) or body text (``level`` 0)."""

    level: int
    text: str


def setext_level(underline: str, above: str) -> int:
    """1 or 2 when ``underline`` makes the line ``above`` a setext heading, else 0."""
    match = _SETEXT.match(underline)
    if not match or len(match.group(1)) < 3 or not above.strip() or _SETEXT.match(above):
        return 0
    return 1 if match.group(1)[0] == "=" else 2


def markdown_bold_title(line: str) -> str:
    """The title of a Markdown line that is one bold phrase and looks like a heading, else ""."""
    match = _MD_BOLD_LINE.match(line)
    if match is None or "**" in match.group("text") or "__" in match.group("text"):
        return ""
    text = match.group("text").strip()
    return text if looks_like_title(text) else ""


def looks_like_title(line: str) -> bool:
    """A short line that starts like a heading and does not end like a sentence."""
    text = line.strip()
    return (
        0 < len(text) <= _TITLE_MAX_CHARS
        and len(text.split()) <= _TITLE_MAX_WORDS
        and (text[0].isupper() or text[0].isdigit() or _uncased_letter(text[0]))
        and not text.endswith(_SENTENCE_END)
    )


def _uncased_letter(char: str) -> bool:
    """A letter of a script without capitals (Chinese, Japanese, Arabic, …): any of its lines may
    start a heading, as a capital does in English."""
    return char.isalpha() and char.lower() == char.upper()


def plain_text_blocks(text: str) -> list[TextBlock]:
    """``text`` as headings and body text, in order; body text keeps its lines and blank lines.

    Headings: a setext-underlined line, or a lone title line (blank lines, or the
    start, before and after it) followed by body text. A lone title line that
    opens the document is its title (level 1); later ones are sections (level 2).
    """
    lines = text.splitlines()
    blocks: list[TextBlock] = []
    body: list[str] = []

    def flush() -> None:
        joined = "\n".join(body).strip()
        if joined:
            blocks.append(TextBlock(0, joined))
        body.clear()

    index = 0
    while index < len(lines):
        line = lines[index]
        following = lines[index + 1] if index + 1 < len(lines) else ""
        before_blank = index == 0 or not lines[index - 1].strip()
        level = setext_level(following, line) if before_blank else 0
        if level:
            flush()
            blocks.append(TextBlock(level, line.strip()))
            index += 2
            continue
        after_blank = not following.strip()
        if before_blank and after_blank and looks_like_title(line) and _body_follows(lines, index + 1):
            flush()
            blocks.append(TextBlock(2 if blocks else 1, line.strip()))  # flush() emptied body
            index += 1
            continue
        body.append(line)
        index += 1
    flush()
    return blocks


def _body_follows(lines: list[str], start: int) -> bool:
    """Whether the next non-blank line opens a paragraph (not another lone short line, not the end)."""
    index = start
    while index < len(lines) and not lines[index].strip():
        index += 1
    if index >= len(lines):
        return False
    following = lines[index + 1] if index + 1 < len(lines) else ""
    # An underlined line is a heading, and a heading is where body text resumes.
    if setext_level(following, lines[index]):
        return True
    # A paragraph: a line that ends like a sentence, or that has more lines after it.
    return bool(following.strip()) or not looks_like_title(lines[index])
