"""The retrieval evaluation set: every document parses, questions point at real documents, and the scores."""

from __future__ import annotations

import io
import re
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from bench.retrieval_eval import (
    DATA_DIR,
    KINDS,
    EvalQuestion,
    EvalSet,
    build_docx,
    build_pdf,
    load_eval_set,
    markdown_blocks,
    recall_at,
    reciprocal_rank,
    summarize,
)
from services.retriever.parsing import DOCX, HTML, MARKDOWN, PDF, PLAIN_TEXT, Section, parse_document

MINIMUM_PER_KIND = {"paraphrased": 30, "confusable": 40, "multi_section": 30, "lexical": 30}


@pytest.fixture(scope="module")
def eval_set() -> EvalSet:
    return load_eval_set()


@pytest.fixture(scope="module")
def neutral_set() -> EvalSet:
    return load_eval_set(neutral_ids=True)


@pytest.fixture(scope="module")
def parsed(eval_set: EvalSet) -> dict[str, list[Section]]:
    """Each document's sections as the retriever's parser gives them."""
    return {d.document_id: parse_document(d.data, d.mime_type) for d in eval_set.documents}


@pytest.fixture(scope="module")
def parsed_text(parsed: dict[str, list[Section]]) -> dict[str, str]:
    """Each document's parsed text, headings included, whitespace collapsed.

    A section that goes on over a page break keeps its heading on the next page;
    the heading is written once, where the section starts, as a reader sees it.
    """
    out = {}
    for document_id, sections in parsed.items():
        parts, path = [], None
        for section in sections:
            parts.append(section.text if section.path == path else f"{section.heading} {section.text}")
            path = section.path
        out[document_id] = " ".join(" ".join(parts).split())
    return out


def _words(text: str) -> set[str]:
    return set(re.findall(r"[\w'-]+", text.lower()))


def test_the_set_has_enough_documents_in_all_five_formats_in_roughly_equal_shares(eval_set: EvalSet) -> None:
    formats = Counter(d.mime_type for d in eval_set.documents)

    assert len(eval_set.documents) >= 44
    assert set(formats) == {PLAIN_TEXT, MARKDOWN, HTML, PDF, DOCX}
    assert min(formats.values()) >= len(eval_set.documents) // 5 - 1
    assert len({d.document_id for d in eval_set.documents}) == len(eval_set.documents)


def test_every_document_parses_into_realistic_text(parsed_text: dict[str, str]) -> None:
    lengths = {document_id: len(text.split()) for document_id, text in parsed_text.items()}

    too_short_or_long = {d: n for d, n in lengths.items() if not 300 <= n <= 1500}
    assert not too_short_or_long


def test_built_pdf_and_docx_keep_every_paragraph_and_heading_of_their_source(
    eval_set: EvalSet, parsed_text: dict[str, str]
) -> None:
    built = [d for d in eval_set.documents if d.mime_type in (PDF, DOCX)]
    assert built

    for document in built:
        source = (DATA_DIR / "sources" / f"{document.filename}.md").read_text()
        blocks = markdown_blocks(source)
        assert sum(1 for level, _ in blocks if level) >= 4, document.filename  # several sections
        missing = [text for _, text in blocks if text not in parsed_text[document.document_id]]
        assert not missing, document.filename


def test_docx_headings_become_the_parsers_section_headings(
    eval_set: EvalSet, parsed: dict[str, list[Section]]
) -> None:
    for document in (d for d in eval_set.documents if d.mime_type == DOCX):
        source = (DATA_DIR / "sources" / f"{document.filename}.md").read_text()
        headings = [s.heading for s in parsed[document.document_id]]
        assert headings == [text for level, text in markdown_blocks(source) if level]


def test_building_twice_gives_the_same_bytes() -> None:
    """No timestamps or random ids in the built files: a rerun measures the same documents."""
    pdf_source = (DATA_DIR / "sources" / "coffee-tendal.pdf.md").read_text()
    docx_source = (DATA_DIR / "sources" / "lang-vennish.docx.md").read_text()

    assert build_pdf.__wrapped__(pdf_source) == build_pdf.__wrapped__(pdf_source)
    docx = build_docx.__wrapped__(docx_source)
    assert docx == build_docx.__wrapped__(docx_source)
    # A DOCX is a zip: members dated now would differ from one run to the next.
    with zipfile.ZipFile(io.BytesIO(docx)) as archive:
        assert {member.date_time for member in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}


def test_questions_have_gold_documents_that_exist_and_each_kind_its_minimum(eval_set: EvalSet) -> None:
    ids = {d.document_id for d in eval_set.documents}
    kinds = Counter(q.kind for q in eval_set.questions)

    assert len(eval_set.questions) >= 130
    assert all(q.gold_document_ids and set(q.gold_document_ids) <= ids for q in eval_set.questions)
    assert set(kinds) == set(KINDS)
    assert {kind: kinds[kind] >= minimum for kind, minimum in MINIMUM_PER_KIND.items()} == dict.fromkeys(
        MINIMUM_PER_KIND, True
    )
    assert len({q.text for q in eval_set.questions}) == len(eval_set.questions)


def test_look_alike_pairs_are_marked_both_ways(eval_set: EvalSet) -> None:
    by_id = {d.document_id: d for d in eval_set.documents}
    twinned = [d for d in eval_set.documents if d.twin]

    assert len(twinned) // 2 >= 10
    assert all(by_id[by_id[d.twin].twin] is d and d.twin != d.document_id for d in twinned)
    # Twins come in different formats, so the format never tells them apart.
    assert all(d.mime_type != by_id[d.twin].mime_type for d in twinned)
    assert len(twinned) < len(eval_set.documents)  # unrelated documents are mixed in


def test_twins_share_much_of_their_vocabulary(eval_set: EvalSet, parsed_text: dict[str, str]) -> None:
    words = {document_id: _words(text) for document_id, text in parsed_text.items()}

    def overlap(first: str, second: str) -> float:
        return len(words[first] & words[second]) / len(words[first] | words[second])

    for document in (d for d in eval_set.documents if d.twin):
        others = [
            d.document_id
            for d in eval_set.documents
            if d.document_id not in (document.document_id, document.twin)
        ]
        # Closer to its twin than to any other document in the set: the topic alone cannot decide.
        assert overlap(document.document_id, document.twin) > max(
            overlap(document.document_id, o) for o in others
        )


def test_every_confusable_question_is_answered_by_one_member_of_a_pair(eval_set: EvalSet) -> None:
    twin_of = {d.document_id: d.twin for d in eval_set.documents}
    confusable = [q for q in eval_set.questions if q.kind == "confusable"]

    assert all(len(q.gold_document_ids) == 1 and twin_of[q.gold_document_ids[0]] for q in confusable)
    # Both members of every pair are asked about, so a retriever cannot win by preferring one.
    asked = {q.gold_document_ids[0] for q in confusable}
    assert {d.document_id for d in eval_set.documents if d.twin} <= asked


def test_every_lexical_question_shares_a_rare_term_with_its_gold_document_and_not_its_twin(
    eval_set: EvalSet, parsed_text: dict[str, str]
) -> None:
    twin_of = {d.document_id: d.twin for d in eval_set.documents}
    words = {document_id: _words(text) for document_id, text in parsed_text.items()}
    document_frequency: Counter[str] = Counter()
    for vocabulary in words.values():
        document_frequency.update(vocabulary)

    for question in (q for q in eval_set.questions if q.kind == "lexical"):
        gold = question.gold_document_ids[0]
        twin_words = words[twin_of[gold]] if twin_of[gold] else set()
        rare = [
            w
            for w in _words(question.text)
            if w in words[gold] and w not in twin_words and document_frequency[w] <= 2
        ]
        assert rare, question.text


def test_neutral_ids_hide_file_names_and_titles(eval_set: EvalSet, neutral_set: EvalSet) -> None:
    originals = {d.document_id for d in eval_set.documents} | {d.title for d in eval_set.documents}

    for document in neutral_set.documents:
        assert re.fullmatch(r"doc-\d{3}", document.document_id)
        assert document.title == document.document_id
        assert document.filename == document.document_id + Path(document.filename).suffix
        assert not any(o in (document.document_id, document.title, document.filename) for o in originals)
    # Twins are not numbered side by side.
    numbers = {d.document_id: int(d.document_id[4:]) for d in neutral_set.documents}
    assert not all(
        abs(numbers[d.document_id] - numbers[d.twin]) == 1 for d in neutral_set.documents if d.twin
    )


def test_neutral_ids_name_the_same_documents_and_questions(eval_set: EvalSet, neutral_set: EvalSet) -> None:
    neutral_by_data = {d.data: d for d in neutral_set.documents}
    renamed = {d.document_id: neutral_by_data[d.data].document_id for d in eval_set.documents}

    assert [d.mime_type for d in neutral_set.documents] == [d.mime_type for d in eval_set.documents]
    assert all(renamed[d.twin] == neutral_by_data[d.data].twin for d in eval_set.documents if d.twin)
    for plain, neutral in zip(eval_set.questions, neutral_set.questions, strict=True):
        assert (neutral.text, neutral.kind) == (plain.text, plain.kind)
        assert neutral.gold_document_ids == [renamed[g] for g in plain.gold_document_ids]


def test_recall_counts_documents_not_chunks_and_shares_of_several_golds() -> None:
    ranked = ["b", "b", "a", "c", "a", "d"]  # several chunks of one document count once

    assert recall_at(ranked, ["a"], 1) == 0.0
    assert recall_at(ranked, ["a"], 2) == 1.0
    assert recall_at(ranked, ["a", "d"], 3) == 0.5
    assert recall_at(ranked, ["a", "d"], 4) == 1.0
    assert recall_at([], ["a"], 5) == 0.0


def test_reciprocal_rank_is_one_over_the_first_gold_documents_rank() -> None:
    assert reciprocal_rank(["a", "b"], ["a"]) == 1.0
    assert reciprocal_rank(["b", "b", "c", "a"], ["a", "c"]) == 0.5
    assert reciprocal_rank(["b", "c"], ["a"]) == 0.0


def test_summary_gives_each_kind_and_all_questions_their_mean_scores() -> None:
    twin_miss = EvalQuestion("which valley?", ["x"], "confusable")
    twin_hit = EvalQuestion("which river?", ["y"], "confusable")
    code = EvalQuestion("what is QS-1?", ["z"], "lexical")
    results = [(twin_miss, ["y", "x"]), (twin_hit, ["y", "x"]), (code, ["a", "b", "c", "d", "z"])]

    summary = summarize(results)

    assert list(summary) == ["confusable", "lexical", "all"]
    assert summary["confusable"].questions == 2
    assert summary["confusable"].recall == {1: 0.5, 3: 1.0, 5: 1.0}
    assert summary["confusable"].mrr == 0.75
    assert summary["lexical"].recall == {1: 0.0, 3: 0.0, 5: 1.0}
    assert summary["lexical"].mrr == 0.2
    assert summary["all"].questions == 3
    assert summary["all"].recall[1] == round(1 / 3, 4)
    assert summary["all"].mrr == round((0.5 + 1.0 + 0.2) / 3, 4)


def test_a_document_of_an_unknown_format_is_refused(tmp_path: Path) -> None:
    (tmp_path / "documents.json").write_text('[{"id": "x", "file": "x.rtf", "title": "X", "twin": ""}]')
    (tmp_path / "questions.jsonl").write_text("")

    with pytest.raises(ValueError, match=r"x\.rtf"):
        load_eval_set(data_dir=tmp_path)
