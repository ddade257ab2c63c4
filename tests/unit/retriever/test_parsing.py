"""Parsing: each supported format becomes sections with headings and pages; bad input is refused clearly."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidArgument
from services.retriever import parsing
from services.retriever.chunking import TokenChunker
from services.retriever.parsing import (
    DOCX,
    HTML,
    MARKDOWN,
    PDF,
    PLAIN_TEXT,
    normalize_mime_type,
    parse_document,
)
from tests.support.documents import content_stream_pdf, docx_document, text_pdf


def test_markdown_sections_follow_headings_and_ignore_hashes_in_code() -> None:
    text = b"Intro line.\n\n# First\nAlpha text.\n```\n# not a heading\n```\n## Second ##\nBeta text.\n"
    sections = parse_document(text, MARKDOWN)
    assert [(s.heading, s.text.splitlines()[0]) for s in sections] == [
        ("", "Intro line."),
        ("First", "Alpha text."),
        ("Second", "Beta text."),
    ]
    assert "# not a heading" in sections[1].text


def test_html_drops_scripts_and_styles_and_keeps_headings() -> None:
    html = (
        b"<html><head><title>T</title><style>p{}</style></head><body>"
        b"<script>var hidden = 1;</script><h1>Bees</h1><p>Bees make <b>honey</b>.</p>"
        b"<h2>Wax</h2><ul><li>Cells are hexagonal.</li></ul></body></html>"
    )
    sections = parse_document(html, HTML)
    assert [(s.heading, s.text) for s in sections] == [
        ("Bees", "Bees make honey."),
        ("Wax", "Cells are hexagonal."),
    ]
    assert all("hidden" not in s.text for s in sections)


def test_pdf_sections_carry_page_numbers() -> None:
    data = text_pdf([["Page one talks about magma."], ["Page two (with parentheses) talks about ash."]])
    sections = parse_document(data, PDF)
    assert [s.page for s in sections] == [1, 2]
    assert "magma" in sections[0].text
    assert "(with parentheses)" in sections[1].text


def test_docx_heading_styles_become_headings() -> None:
    data = docx_document(
        [("Heading 1", "Openings"), ("Normal", "Control the centre."), ("Heading 2", "Castling")]
    )
    data_with_body = docx_document(
        [
            ("Heading 1", "Openings"),
            ("Normal", "Control the centre."),
            ("Heading 2", "Castling"),
            ("Normal", "King safety."),
        ]
    )
    # A last heading with nothing under it is kept as its own words, not dropped.
    assert [(s.heading, s.text) for s in parse_document(data, DOCX)] == [
        ("Openings", "Control the centre."),
        ("Castling", "Castling"),
    ]
    assert [(s.heading, s.text) for s in parse_document(data_with_body, DOCX)] == [
        ("Openings", "Control the centre."),
        ("Castling", "King safety."),
    ]


@pytest.mark.parametrize(
    ("data", "mime_type", "message"),
    [
        (b"%PDF-1.4\n this is not really a pdf", PDF, "not a readable PDF"),
        (b"PK\x03\x04 broken zip", DOCX, "not a readable DOCX"),
        (b"", PLAIN_TEXT, "empty"),
        (b"   \n\t  ", PLAIN_TEXT, "no extractable text"),
        (b"<html><body><script>x()</script></body></html>", HTML, "no extractable text"),
        (b"caf\xe9 au lait", PLAIN_TEXT, "not valid UTF-8"),
    ],
)
def test_unreadable_or_empty_documents_are_invalid(data: bytes, mime_type: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as caught:
        parse_document(data, mime_type)
    assert caught.value.field == "data"


def test_mime_type_comes_from_header_or_file_extension() -> None:
    assert normalize_mime_type("text/markdown; charset=utf-8") == MARKDOWN
    assert normalize_mime_type("", source="notes/guide.HTM") == HTML
    with pytest.raises(InvalidArgument, match="unsupported type 'image/png'") as caught:
        normalize_mime_type("image/png")
    assert caught.value.field == "header.mime_type"
    with pytest.raises(InvalidArgument, match=r"\(empty\)"):
        normalize_mime_type("", source="archive.zip")


def test_markdown_sections_carry_their_heading_path() -> None:
    from services.retriever.parsing import MARKDOWN, parse_document

    doc = b"# Kovari Cooperative\nIntro.\n## Farming\n### Soil\nRed clay.\n## Trade\nExports.\n"
    sections = parse_document(doc, MARKDOWN)
    assert [(s.heading, s.path) for s in sections] == [
        ("Kovari Cooperative", ("Kovari Cooperative",)),
        ("Soil", ("Kovari Cooperative", "Farming", "Soil")),
        ("Trade", ("Kovari Cooperative", "Trade")),
    ]


def test_html_sections_carry_their_heading_path() -> None:
    from services.retriever.parsing import HTML, parse_document

    doc = b"<h1>Planet Ostra</h1><p>A world.</p><h2>Climate</h2><p>Cold.</p><h2>Moons</h2><p>Two.</p>"
    assert [s.path for s in parse_document(doc, HTML)] == [
        ("Planet Ostra",),
        ("Planet Ostra", "Climate"),
        ("Planet Ostra", "Moons"),
    ]


def test_plain_text_underlined_lines_become_headings_under_the_title() -> None:
    text = (
        b"Gravel Pits of Hesk\n===================\n\nThe pits were dug from 1890.\n\n"
        b"Flooding\n--------\n\nThe lowest pit flooded in 1931\nand became a lake.\n\n"
        b"Birds\n-----\n\nGrebes nest on the lake.\n"
    )
    sections = parse_document(text, PLAIN_TEXT)
    assert [(s.path, s.text) for s in sections] == [
        (("Gravel Pits of Hesk",), "The pits were dug from 1890."),
        (("Gravel Pits of Hesk", "Flooding"), "The lowest pit flooded in 1931\nand became a lake."),
        (("Gravel Pits of Hesk", "Birds"), "Grebes nest on the lake."),
    ]


def test_plain_text_lone_title_lines_are_headings_but_sentences_and_lists_are_not() -> None:
    text = (
        b"Harbour Rules\n\nBoats must be moored bow-in.\n\n"
        b"Fees\n\nA berth costs 12 crowns a night.\n\n"
        b"Thanks for reading.\n\n"
        b"Opening times\n\nMonday\nTuesday\nWednesday\n"
    )
    sections = parse_document(text, PLAIN_TEXT)
    assert [(s.path, s.text) for s in sections] == [
        (("Harbour Rules",), "Boats must be moored bow-in."),
        # "Thanks for reading." ends like a sentence: text of the section it is in.
        (("Harbour Rules", "Fees"), "A berth costs 12 crowns a night.\n\nThanks for reading."),
        # The list's lines are not lone lines: body text, not headings.
        (("Harbour Rules", "Opening times"), "Monday\nTuesday\nWednesday"),
    ]


def test_plain_text_without_headings_is_one_section() -> None:
    text = b"first paragraph, all lower case\n\nsecond paragraph.\n"
    assert [(s.path, s.text) for s in parse_document(text, PLAIN_TEXT)] == [
        ((), "first paragraph, all lower case\n\nsecond paragraph.")
    ]


def test_markdown_setext_headings_are_headings_and_a_rule_after_a_blank_line_is_not() -> None:
    text = b"Ferries\n=======\n\nTwo boats.\n\nTimetable\n---------\nHourly.\n\n---\n\nLast line.\n"
    sections = parse_document(text, MARKDOWN)
    assert [(s.path, s.text) for s in sections if s.text] == [
        (("Ferries",), "Two boats."),
        (("Ferries", "Timetable"), "Hourly.\n\n---\n\nLast line."),
    ]


def test_pdf_headings_come_from_bold_larger_lines_and_paragraphs_from_wide_gaps() -> None:
    pdf = text_pdf(
        [
            ["# Salt Marsh Survey", "The survey counted birds on the", "marsh in May.", "",
             "It ran for six weeks and", "covered the whole shore.", "# Methods", "Counts were made at dawn",
             "from four hides."],
            ["at low tide.", "# Results", "Redshank were commonest."],
        ]
    )  # fmt: skip
    sections = parse_document(pdf, PDF)
    assert [(s.path, s.page, s.text) for s in sections] == [
        (
            ("Salt Marsh Survey",),
            1,
            "The survey counted birds on the\nmarsh in May.\n\nIt ran for six weeks and\ncovered the whole shore.",
        ),
        (("Salt Marsh Survey", "Methods"), 1, "Counts were made at dawn\nfrom four hides."),
        # The section goes on over the page break under the same heading.
        (("Salt Marsh Survey", "Methods"), 2, "at low tide."),
        (("Salt Marsh Survey", "Results"), 2, "Redshank were commonest."),
    ]


def test_pdf_chunks_follow_its_sections() -> None:
    pdf = text_pdf([["# Quarry Report", "Stone was cut here.", "# Closure", "The quarry shut in 1961."]])
    chunks = TokenChunker(lambda text: [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]).chunk(
        parse_document(pdf, PDF)
    )
    assert [(c.heading_path, c.text) for c in chunks] == [
        (("Quarry Report",), "Stone was cut here."),
        (("Quarry Report", "Closure"), "The quarry shut in 1961."),
    ]


def test_pdf_bold_words_inside_a_body_line_do_not_make_it_a_heading() -> None:
    pdf = content_stream_pdf(
        b"BT /F2 14 Tf 14 TL 50 760 Td (Tide Tables) Tj T* T* /F1 11 Tf "
        b"(High water is ) Tj /F2 11 Tf (twice) Tj /F1 11 Tf ( a day at Hesk.) Tj T* "
        b"(Low water follows six hours later.) Tj T* ET"
    )
    sections = parse_document(pdf, PDF)
    assert [(s.path, s.text) for s in sections] == [
        (("Tide Tables",), "High water is twice a day at Hesk.\nLow water follows six hours later.")
    ]


def test_a_pdf_whose_layout_cannot_be_read_is_still_ingested_page_by_page(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object) -> None:
        raise ZeroDivisionError("layout bug")

    monkeypatch.setattr(parsing, "pdf_blocks", broken)
    pdf = text_pdf([["# Report", "First page text."], ["Second page text."]])
    sections = parse_document(pdf, PDF)
    assert [(s.page, s.text) for s in sections] == [(1, "Report\nFirst page text."), (2, "Second page text.")]
    assert "PDF layout analysis failed" in caplog.text


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(["", "===", "---", "Heading", "A sentence.", "x" * 90, "  ", "- item", "1. One"]),
            st.text(alphabet=st.characters(codec="utf-8"), max_size=40),
        ),
        max_size=30,
    )
)
def test_plain_text_headings_never_lose_or_invent_text(lines: list[str]) -> None:
    text = "\n".join(lines)
    if not text.strip():
        return
    # Control characters are dropped on purpose (the next test): the words are those left.
    words = [w for w in parsing._printable(text).split() if set(w) - {"=", "-"}]
    try:
        sections = parse_document(text.encode(), PLAIN_TEXT)
    except InvalidArgument:
        return  # nothing but underlines: no extractable text, refused as such
    parsed = " ".join(" ".join((*s.path, s.text)) for s in sections).split()
    # Every word is kept (in a heading or in body text); only underlines may go.
    for word in words:
        assert word in parsed


def test_plain_text_lone_title_lines_under_an_underlined_title_are_its_sections() -> None:
    text = b"Hesk Quarry\n===========\n\nSummary\n\nStone was cut here.\n\nClosure\n\nIt shut in 1961.\n"
    assert [(s.path, s.text) for s in parse_document(text, PLAIN_TEXT)] == [
        (("Hesk Quarry", "Summary"), "Stone was cut here."),
        (("Hesk Quarry", "Closure"), "It shut in 1961."),
    ]


def test_markdown_bold_lines_on_their_own_are_headings_under_the_real_ones() -> None:
    text = (
        b"# Hesk Ferry\n\nRuns all year.\n\n**Timetable**\n\nHourly from six.\n\n"
        b"**Fares are cash only.**\n\nA **bold** word in a line.\n"
    )
    sections = parse_document(text, MARKDOWN)
    assert [(s.path, s.text) for s in sections] == [
        (("Hesk Ferry",), "Runs all year."),
        # A bold sentence and a bold word inside a line stay body text.
        (
            ("Hesk Ferry", "Timetable"),
            "Hourly from six.\n\n**Fares are cash only.**\n\nA **bold** word in a line.",
        ),
    ]


def test_html_paragraphs_all_in_bold_are_headings_but_a_bold_lead_in_is_not() -> None:
    html = (
        b"<h1>Hesk Ferry</h1><p>Runs all year.</p><p><strong>Opening hours</strong></p>"
        b"<p>Daily from six.</p><p><b>Note:</b> cash only.</p>"
    )
    sections = parse_document(html, HTML)
    assert [(s.path, s.text) for s in sections] == [
        (("Hesk Ferry",), "Runs all year."),
        (("Hesk Ferry", "Opening hours"), "Daily from six.\nNote: cash only."),
    ]


def test_docx_bold_short_paragraphs_are_headings_but_bold_sentences_are_not() -> None:
    data = docx_document(
        [
            ("Heading 1", "Hesk Ferry"),
            ("Normal", "Runs all year."),
            ("bold", "Timetable"),
            ("Normal", "Hourly from six."),
            ("bold", "Fares are cash only."),
        ]
    )
    assert [(s.path, s.text) for s in parse_document(data, DOCX)] == [
        (("Hesk Ferry",), "Runs all year."),
        (("Hesk Ferry", "Timetable"), "Hourly from six.\nFares are cash only."),
    ]


WESTERN = "Crème brûlée\n\nThe café’s naïve façade — “quoted” — by señor Muñoz.\n"


@pytest.mark.parametrize(
    "data",
    [
        WESTERN.encode("utf-16"),  # Windows Notepad's "Unicode": a UTF-16 LE byte-order mark
        b"\xfe\xff" + WESTERN.encode("utf-16-be"),
        WESTERN.encode("utf-32"),
        b"\xef\xbb\xbf" + WESTERN.encode("utf-8"),
        WESTERN.encode("utf-8"),
    ],
    ids=["utf-16-le-bom", "utf-16-be-bom", "utf-32-bom", "utf-8-bom", "utf-8"],
)
def test_text_in_a_unicode_encoding_is_read_by_its_byte_order_mark(data: bytes) -> None:
    sections = parse_document(data, PLAIN_TEXT)
    assert [(s.heading, s.text) for s in sections] == [
        ("Crème brûlée", "The café’s naïve façade — “quoted” — by señor Muñoz.")
    ]


def test_a_declared_charset_is_how_a_legacy_encoding_is_read_and_an_undeclared_one_says_how() -> None:
    from services.retriever.text_encoding import declared_charset

    legacy = WESTERN.encode("cp1252")
    charset = declared_charset("text/markdown; charset=windows-1252")
    assert charset == "windows-1252"
    assert "The café’s naïve façade" in parse_document(legacy, MARKDOWN, charset)[0].text
    assert "café’s" in parse_document(legacy.replace(b"\n\n", b"\n\n<p>") + b"</p>", HTML, charset)[0].text
    # Undeclared, it is refused with the way to declare it, never guessed into mojibake.
    with pytest.raises(InvalidArgument, match="charset=windows-1252") as caught:
        parse_document(legacy, PLAIN_TEXT)
    assert caught.value.field == "data"
    # Bytes the declared charset cannot decode, and a charset nobody knows, are refused by name.
    with pytest.raises(InvalidArgument, match="not valid utf-8"):
        parse_document(legacy, PLAIN_TEXT, "utf-8")
    with pytest.raises(InvalidArgument, match="unknown charset 'klingon'") as unknown:
        declared_charset('text/plain; charset="klingon"')
    assert unknown.value.field == "header.mime_type"
    assert declared_charset("text/plain") is None
    # Python's registry also holds codecs that decode no text, and reads names padded with any
    # punctuation: each was an INTERNAL error at ingest (decoding; the stored type's length).
    for hostile in ("hex", "base64", "rot13", "zlib", "utf" + "-" * 300 + "8"):
        with pytest.raises(InvalidArgument) as refused:
            declared_charset(f"text/plain; charset={hostile}")
        assert refused.value.field == "header.mime_type"


def test_control_characters_and_terminal_escapes_never_reach_the_index() -> None:
    data = b"Safe \x1b[31mred\x1b[0m heading\n=======\n\nNUL\x00 here,\x07 a bell\x7f and a page\x0cbreak.\n"
    (section,) = parse_document(data, PLAIN_TEXT)
    assert section.heading == "Safe red heading"
    assert section.text == "NUL here, a bell and a page\nbreak."
    html = parse_document(b"<h1>T\x1b]0;title\x07</h1><p>a\x00b</p>", HTML)
    assert all(not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", s.text + s.heading) for s in html)


def _encrypted(pdf: bytes, user_password: str, algorithm: str) -> bytes:
    import io

    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf)))
    writer.encrypt(user_password=user_password, owner_password="owner-secret", algorithm=algorithm)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


@pytest.mark.parametrize("algorithm", ["RC4-128", "AES-128", "AES-256"])
def test_a_pdf_locked_only_against_printing_is_read_and_one_needing_a_password_is_refused(
    algorithm: str,
) -> None:
    pdf = text_pdf([["# Owls", "Owls nest in hollow trees and hunt at night."]])

    opened = parse_document(_encrypted(pdf, "", algorithm), PDF)
    assert [(s.heading, s.text) for s in opened] == [(s.heading, s.text) for s in parse_document(pdf, PDF)]
    with pytest.raises(InvalidArgument, match="needs a password") as caught:
        parse_document(_encrypted(pdf, "open-sesame", algorithm), PDF)
    assert caught.value.field == "data"


def test_a_pdf_with_no_text_layer_is_refused_as_a_scan_needing_ocr() -> None:
    # Only drawing operators: what a scanned page is to a text extractor (a picture).
    with pytest.raises(InvalidArgument, match="scanned PDF needs OCR") as caught:
        parse_document(content_stream_pdf(b"0.5 g 72 72 468 648 re f"), PDF)
    assert caught.value.field == "data"


def test_a_pdf_still_being_read_at_the_deadline_is_refused_naming_data_and_the_pages_read() -> None:
    # A few kilobytes of Flate-compressed content stand for 8 × 150,000 text runs: each page
    # takes pypdf over a second to read, so the whole would take many times the deadline.
    runs = b"BT /F1 11 Tf 50 760 Td " + b"(a) Tj " * 150_000 + b"ET"
    bomb = content_stream_pdf(runs, pages=8, compress=True)
    assert len(bomb) < 20_000
    with pytest.raises(
        InvalidArgument, match=r"PDF took longer than 0.5 s to read \((\d) of 8 pages read\)"
    ) as caught:
        parse_document(bomb, PDF, max_seconds=0.5)
    assert caught.value.field == "data" and "--max-parse-seconds" in str(caught.value)
    read = re.search(r"\((\d) of 8", str(caught.value))
    assert read is not None and int(read.group(1)) < 8
    # An ordinary PDF of the same pages' count reads well within the same deadline.
    pages = parse_document(
        content_stream_pdf(b"BT /F1 11 Tf 50 760 Td (Granite) Tj ET", pages=8), PDF, max_seconds=0.5
    )
    assert [s.page for s in pages] == list(range(1, 9))


def test_html_text_outside_paragraphs_is_kept_as_a_reader_sees_it() -> None:
    # Text straight in a <div>, <section> or the body was dropped whenever the page also had a <p>;
    # inline tags split words ("H 2 O"); <br> and table rows ran together.
    html = (
        b"<body><div>Opening hours are posted at the gate.</div>"
        b"<section>Dogs must stay on a lead.</section><p>H<sub>2</sub>O and CO<sub>2</sub> levels: the "
        b"<b>API</b>s report both.</p><p>12 Harbour Road<br>Hesk<br/>HK1 2AB</p>"
        b"<table><tr><th>Boat</th><th>Seats</th></tr><tr><td>Osprey</td><td>40</td></tr></table>"
        b"Last ferry at <i>nine</i>.</body>"
    )
    [section] = parse_document(html, HTML)
    assert section.text.splitlines() == [
        "Opening hours are posted at the gate.",
        "Dogs must stay on a lead.",
        "H2O and CO2 levels: the APIs report both.",
        "12 Harbour Road",
        "Hesk",
        "HK1 2AB",
        "Boat | Seats",
        "Osprey | 40",
        "Last ferry at nine.",
    ]


def test_an_unclosed_html_heading_is_named_by_its_own_words_only() -> None:
    # html.parser nests everything after an unclosed <h2> inside it: the whole rest of the page
    # became the heading (and so the heading path of every chunk under it).
    html = b"<h1>Hesk Ferry</h1><h2>Timetable<p>Boats leave hourly.</p><p>No boats on Sunday.</p>"
    sections = parse_document(html, HTML)
    assert [(s.path, s.text) for s in sections] == [
        (("Hesk Ferry", "Timetable"), "Boats leave hourly.\nNo boats on Sunday."),
    ]


def test_a_markdown_code_fence_is_closed_only_by_its_own_marker() -> None:
    # A ~~~ line inside a ``` block closed it, so "# comment" lines in the code became headings.
    text = b"# Setup\n\n```sh\n~~~\n# install the tools\nmake setup\n```\n\n# Usage\n\nRun it.\n"
    sections = parse_document(text, MARKDOWN)
    assert [s.heading for s in sections] == ["Setup", "Usage"]
    assert "# install the tools\nmake setup" in sections[0].text


def test_plain_text_chinese_title_lines_are_headings_but_sentences_are_not() -> None:
    text = (
        "检索服务说明\n\n本文介绍检索服务。\n\n安装步骤\n\n先安装依赖，再启动服务。\n\n"
        "这一行是一个完整的句子。\n\n最后一段。\n"
    ).encode()
    sections = parse_document(text, PLAIN_TEXT)
    assert [(s.path, s.text) for s in sections] == [
        (("检索服务说明",), "本文介绍检索服务。"),
        (("检索服务说明", "安装步骤"), "先安装依赖，再启动服务。\n\n这一行是一个完整的句子。\n\n最后一段。"),
    ]


def test_a_document_of_only_invisible_characters_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="data: document has no extractable text"):
        parse_document("\u200b\ufeff\u2060 \u00ad\n".encode(), PLAIN_TEXT)


def _texts(data: bytes, mime_type: str) -> list[tuple[str, str]]:
    return [(s.heading, s.text) for s in parsing.parse_document(data, mime_type)]


@pytest.mark.parametrize(
    ("data", "mime_type"),
    [
        (b"name,age,city\nAlice,31,Paris\nBob,,Lyon\n", "text/csv"),
        (b"name;age;city\r\nAlice;31;Paris\r\n\r\nBob;;Lyon\r\n", "text/csv"),  # European Excel
        (b"name\tage\tcity\nAlice\t31\tParis\nBob\t\tLyon\n", "text/tab-separated-values"),
        (b'\xef\xbb\xbfname,age,city\n"Alice",31,"Paris"\nBob,,Lyon\n', "text/csv"),  # BOM, quotes
    ],
)
def test_csv_records_name_each_value_by_its_column(data: bytes, mime_type: str) -> None:
    # An empty cell says nothing (no "age: " with nothing after it); each record is a paragraph.
    assert _texts(data, mime_type) == [("", "name: Alice; age: 31; city: Paris\n\nname: Bob; city: Lyon")]


def test_csv_without_a_header_row_keeps_its_cells_and_extra_cells_are_numbered() -> None:
    assert _texts(b"1,2,3\n4,5,6\n", "text/csv") == [("", "1, 2, 3\n\n4, 5, 6")]
    ragged = b"question,answer\nWhere is it?,Oslo,see map\n"
    assert _texts(ragged, "text/csv") == [("", "question: Where is it?; answer: Oslo; column 3: see map")]


def test_json_objects_give_a_section_per_key_and_a_paragraph_per_record() -> None:
    data = {
        "title": "Handbook",
        "version": 3,
        "leave": [{"kind": "annual", "days": 25}, {"kind": "sick", "paid": True, "note": ""}],
        "owner": {"team": "HR", "contact": {"email": "hr@example.com"}},
    }
    assert _texts(json.dumps(data).encode(), "application/json") == [
        ("", "title: Handbook\nversion: 3"),
        ("leave", "kind: annual\ndays: 25\n\nkind: sick\npaid: true"),
        # An object's lines keep their whole path: a chunk of it still says whose value it is.
        ("owner", "owner.team: HR\nowner.contact.email: hr@example.com"),
    ]
    records = [{"q": "Where?", "a": ["Oslo", "Bergen"]}, {"q": "When?", "a": None}]
    assert _texts(json.dumps(records).encode(), "application/json") == [
        ("", "q: Where?\na: Oslo, Bergen\n\nq: When?\na: null")
    ]
    lines = b'{"q": "Where?"}\n\n{"q": "When?"}\n'
    assert _texts(lines, "application/x-ndjson") == [("", "q: Where?\n\nq: When?")]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"a": ', "not valid JSON"),
        (b"[" * 100 + b"]" * 100, "nested more than 64 levels"),
        (b"[" * 5000 + b"]" * 5000, "nested more than 64 levels"),  # past Python's own stack
        (b"{}", "no extractable text"),
    ],
)
def test_json_that_cannot_be_read_is_refused_naming_the_data(data: bytes, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as caught:
        parsing.parse_document(data, "application/json")
    assert caught.value.field == "data"


def test_a_bad_json_line_is_named_by_its_number_and_a_long_csv_cell_is_read_whole() -> None:
    with pytest.raises(InvalidArgument, match="not valid JSON: line 3: Expecting value"):
        parsing.parse_document(b'{"q": 1}\n\nnot json\n', "application/x-ndjson")
    article = "word " * 60_000  # 300 KB in one cell: past csv's default 128 KiB field limit
    sections = parsing.parse_document(f"title,body\nOn rivers,{article}\n".encode(), "text/csv")
    assert sections[0].text == f"title: On rivers; body: {article.strip()}"


def test_tabular_formats_are_known_by_extension_and_common_aliases() -> None:
    assert parsing.normalize_mime_type("", "people.CSV") == "text/csv"
    assert parsing.normalize_mime_type("", "dump.jsonl") == "application/x-ndjson"
    assert parsing.normalize_mime_type("application/csv") == "text/csv"
    assert parsing.normalize_mime_type("text/json; charset=utf-8") == "application/json"


def _docx_with(document_xml: bytes, padding_mib: int = 0) -> bytes:
    """A real DOCX package whose body XML is ``document_xml``, with a part of ``padding_mib``
    MiB of zeros beside it (written a MiB at a time: it zips to ~1/1000 of that)."""
    import io
    import zipfile

    source = zipfile.ZipFile(io.BytesIO(docx_document([("Normal", "x")])))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as package:
        for info in source.infolist():
            body = document_xml if info.filename == "word/document.xml" else source.read(info)
            package.writestr(info.filename, body)
        if padding_mib:
            with package.open("word/media/padding.bin", "w") as padding:
                for _ in range(padding_mib):
                    padding.write(bytes(2**20))
    return out.getvalue()


_W = b'<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body>'
_LAUGHS = (
    b'<?xml version="1.0"?><!DOCTYPE d [<!ENTITY a "aaaaaaaaaa">'
    + b"".join(b'<!ENTITY %c "%s">' % (ord("b") + i, (b"&%c;" % (ord("a") + i)) * 10) for i in range(8))
    + b']><w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body><w:p><w:r><w:t>&i;</w:t></w:r></w:p></w:body></w:document>'
)


@pytest.mark.parametrize(
    ("document_xml", "padding_mib", "message"),
    [
        (b"not xml at all", 0, "not a readable DOCX"),
        # Entities that expand to 10^9 characters: libxml2's amplification limit stops them.
        (_LAUGHS, 0, "not a readable DOCX"),
        (_W + b"<w:tbl>" * 5000 + b"</w:body></w:document>", 0, "not a readable DOCX"),
        # A part that unzips to 257 MiB from ~250 KB: refused from the archive's directory.
        (_W + b"</w:body></w:document>", 257, r"unzips to 25\d MiB, more than the 256 MiB"),
        # Half a million empty paragraphs zip to almost nothing and would cost ~30 s to read.
        (_W + b"<w:p/>" * 500_001 + b"</w:body></w:document>", 0, "500,001 paragraphs"),
    ],
)
def test_a_hostile_docx_is_refused_naming_the_data(
    document_xml: bytes, padding_mib: int, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message) as caught:
        parse_document(_docx_with(document_xml, padding_mib), DOCX)
    assert caught.value.field == "data"


def test_a_docx_reads_the_same_with_its_styles_looked_up_once() -> None:
    # Many paragraphs of few styles: the cached lookups give each paragraph its own style.
    paragraphs = [("Heading 1", "Openings"), ("Normal", "Control the centre.")] * 3 + [("bold", "Endgames")]
    sections = parse_document(docx_document([*paragraphs, ("Normal", "Activate the king.")]), DOCX)
    assert [(s.heading, s.text) for s in sections][-2:] == [
        ("Openings", "Control the centre."),
        ("Endgames", "Activate the king."),
    ]


def test_html_nested_deeper_than_pythons_stack_keeps_its_text_and_headings() -> None:
    page = b"<h1>Deep</h1>" + b"<div>" * 50_000 + b"<p>Still here.</p><h2>Deeper</h2><span>" * 2 + b"End."
    assert [(s.heading, " ".join(s.text.split())) for s in parse_document(page, HTML)] == [
        ("Deep", "Still here."),
        ("Deeper", "Still here."),
        ("Deeper", "End."),
    ]
    # An unterminated comment repeated: no text, and no quadratic rescan of the rest.
    with pytest.raises(InvalidArgument, match="no extractable text"):
        parse_document(b"<!--" * 100_000, HTML)


def test_a_json_key_ending_in_a_bracket_is_a_key_not_a_list_item() -> None:
    data = b'{"items": [{"size[cm]": 12, "tags": ["a", "b"], "grid": [[1, 2], [3]]}]}'
    (section,) = parse_document(data, "application/json")
    assert section.text.splitlines() == ["size[cm]: 12", "tags: a, b", "grid[0]: 1, 2", "grid[1]: 3"]


def test_html_with_control_characters_is_read_without_them() -> None:
    # libxml2 refuses NUL and the other C0 controls in a tree; they are dropped first, as from
    # every format's text (a separator control is a space, so no two words run together).
    page = b"<html><body><h1>Ti\x01tle</h1><p>a\x1fb \x00c</p></body></html>"
    assert [(s.heading, s.text) for s in parse_document(page, HTML)] == [("Title", "a b c")]
