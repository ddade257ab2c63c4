"""What a constraint may cost, on SmolLM2's real vocabulary (llguidance, no model): a schema too
costly at its first token, one whose first token would overflow llguidance's parser, one with
more optional properties than can be written, a grammar's embedded ``%json`` over the schema
budget and a schema that overflows llguidance's symbol table are all refused at compile, naming
the field, with a short message; a refusal is not compiled again; a grammar found too costly
part-way ends that request and is refused from then on; and a compiled grammar's first mask is
computed once, on the compiler thread, not again by every request on the engine thread."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from services.common.errors import InvalidArgument
from services.inference import grammar as grammar_module
from services.inference.grammar import (
    MAX_OPTIONAL_PROPERTIES,
    MAX_SCHEMA_PATTERN_PROPERTIES,
    GrammarCompiler,
    Guide,
)
from services.inference.sampler import RowFault, apply_guides
from services.inference.sampling import Constraint, ConstraintKind

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture()
def compiler(tokenizer: Any) -> GrammarCompiler:
    """A fresh compiler (no cached grammar, no remembered refusal) sharing the module's
    llguidance tokenizer view (~1 s to build)."""
    fresh = GrammarCompiler(tokenizer, VOCAB)
    fresh._tokenizer = _shared_view(tokenizer)
    return fresh


_VIEWS: dict[int, Any] = {}


def _shared_view(tokenizer: Any) -> Any:
    if id(tokenizer) not in _VIEWS:
        _VIEWS[id(tokenizer)] = GrammarCompiler(tokenizer, VOCAB).tokenizer
    return _VIEWS[id(tokenizer)]


def schema(value: Any) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(value))


def allof_of_anyofs(n: int, k: int) -> dict[str, Any]:
    """The audit's 2.4 KB schema (n=3, k=12): 36 properties, far inside the property budget, whose
    ``allOf`` multiplies into k**n object shapes, all open at the first token."""
    return {
        "allOf": [
            {
                "anyOf": [
                    {"type": "object", "properties": {f"a{i}_{j}": {"type": "integer"}}} for j in range(k)
                ]
            }
            for i in range(n)
        ]
    }


def optional(n: int, prefix: str = "field_") -> dict[str, Any]:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(n)}}


def refusal(compiler: GrammarCompiler, constraint: Constraint) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as caught:
        compiler.guide(constraint)
    return caught.value


def write(tokenizer: Any, guide: Guide, text: str) -> list[RowFault | str]:
    """Feed ``text`` through ``guide`` as the engine would (a mask, then the drawn token): the
    faults and refusals met on the way, none when it was written."""
    for token in tokenizer.encode(text, add_special_tokens=False):
        logits = torch.zeros(1, VOCAB)
        faults = apply_guides(logits, [guide])
        if faults:
            return list(faults.values())
        assert torch.isfinite(logits[0, token]), (text, token)
        refused = guide.advance(token)
        if refused:
            return [refused]
    return []


def test_a_schema_too_costly_at_its_first_token_is_refused_at_compile(compiler: GrammarCompiler) -> None:
    """It compiled, and then every request with it spent 0.4-0.9 s building its first mask on the
    engine thread (its neighbours' streams stalled as long), then failed with "Current row has
    32832 items"."""
    caught = refusal(compiler, schema(allof_of_anyofs(3, 12)))
    assert caught.field == "json_schema"
    assert str(caught).startswith("json_schema: ")
    assert "first token" in str(caught) or "too many alternatives" in str(caught), str(caught)


def test_a_schema_whose_first_token_overflows_the_parser_is_refused_saying_why(
    compiler: GrammarCompiler,
) -> None:
    """Twenty objects of 25 optional properties each (each within the per-object bound): 500
    properties open at once; the mask allowed '{"', and consuming it failed the request."""
    objects = {"anyOf": [optional(25, f"o{j}_") for j in range(20)]}
    caught = refusal(compiler, schema(objects))
    assert caught.field == "json_schema"
    assert "too many alternatives at one point" in str(caught), str(caught)
    assert "Current row" not in str(caught)


def test_optional_properties_past_what_can_be_written_are_refused_before_compiling(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """499 optional properties compiled and then failed at the first token with "Current row has
    2003 items; max is 2000"; 5,000 compiled for 4.5 s first (MAX_SCHEMA_PROPERTIES let them by)."""
    for bad in (optional(MAX_OPTIONAL_PROPERTIES + 9), optional(5000)):
        started = time.perf_counter()
        caught = refusal(compiler, schema(bad))
        assert time.perf_counter() - started < 1.0  # refused before any compile
        assert caught.field == "json_schema"
        assert "too many optional properties in one object" in str(caught), str(caught)
    nested = {"type": "object", "properties": {"row": optional(600)}, "required": ["row"]}
    assert "optional properties" in str(refusal(compiler, schema(nested)))
    # The bound is what works: that many optional properties, at the first token and after one.
    guide = compiler.guide(schema(optional(MAX_OPTIONAL_PROPERTIES)))
    last = MAX_OPTIONAL_PROPERTIES - 1
    assert write(tokenizer, guide, f'{{"field_7": 1, "field_{last}": 2}}') == []
    assert guide.matcher.is_accepting()


def test_a_grammars_embedded_json_schemas_have_the_json_schema_budget(compiler: GrammarCompiler) -> None:
    """A ``%json`` in a Lark grammar was not budgeted: 400 patternProperties compiled for ~15 s
    (and 65 for as long as the json_schema budget exists to prevent)."""

    def patterns(n: int, tag: str) -> str:
        return json.dumps(
            {
                "type": "object",
                "patternProperties": {f"^{tag}{i}_[a-z]{{{i % 7}}}$": {"type": "string"} for i in range(n)},
            }
        )

    over = MAX_SCHEMA_PATTERN_PROPERTIES + 1
    for text in (
        f"start: %json {patterns(over, 'a')}",
        f"start: %json\n  {patterns(400, 'b')}",
        # A decoy "%json" whose JSON string runs into the real one does not hide it.
        f'start: /%json ["/ %json {patterns(over, "g")}',
        # Counted over all of a grammar's schemas, as over all of a schema's objects.
        f"start: x y\nx: %json {patterns(over // 2 + 1, 'c')}\ny: %json {patterns(over // 2 + 1, 'd')}",
    ):
        started = time.perf_counter()
        caught = refusal(compiler, Constraint(ConstraintKind.GRAMMAR, text))
        assert time.perf_counter() - started < 1.0, text[:40]
        assert caught.field == "grammar"
        assert f"at most {MAX_SCHEMA_PATTERN_PROPERTIES} patternProperties" in str(caught), str(caught)
    # Each %json is read to its end or its first error: a bounded number of them.
    many = "start: " + " ".join(['"%json ["'] * 200)
    assert "%json schemas" in str(refusal(compiler, Constraint(ConstraintKind.GRAMMAR, many)))
    # Within the budget (and the text "%json" in a literal) compiles as before.
    compiler.guide(Constraint(ConstraintKind.GRAMMAR, f"start: %json {patterns(8, 'f')}"))
    compiler.guide(Constraint(ConstraintKind.GRAMMAR, 'start: "%json {}" | "%json [1, 2"'))


def test_a_schema_past_llguidances_symbol_table_says_so_briefly(compiler: GrammarCompiler) -> None:
    """llguidance panics on it after 0.7-2.7 s: the client got a 2.5 KB backtrace naming the
    server's paths."""
    caught = refusal(compiler, schema(allof_of_anyofs(3, 16)))
    assert caught.field == "json_schema"
    assert "schema too large" in str(caught)
    assert "backtrace" not in str(caught) and "/" not in str(caught) and len(str(caught)) < 300


@pytest.mark.parametrize("bad", [{"type": "bogus"}, allof_of_anyofs(3, 16)], ids=["bogus", "panics"])
def test_a_refused_constraint_is_refused_again_without_compiling(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch, bad: dict[str, Any]
) -> None:
    """Failed compiles were not remembered: a schema that panics after 0.7-2.7 s cost the
    compiler thread as much again on every repeat."""
    constraint = schema(bad)
    caught = refusal(compiler, constraint)
    assert compiler.is_compiled(constraint)  # a repeat is refused at once, off the compiler thread
    compiles: list[Constraint] = []
    real = grammar_module.to_llguidance

    def counted(c: Constraint) -> str:
        compiles.append(c)
        return real(c)

    monkeypatch.setattr(grammar_module, "to_llguidance", counted)
    again = refusal(compiler, constraint)
    assert (again.field, str(again)) == (caught.field, str(caught))
    assert compiles == []


def test_the_first_mask_is_computed_once_per_grammar_not_per_request(compiler: GrammarCompiler) -> None:
    """The start check computed the first mask on a throwaway copy: every request computed it
    again, on the engine thread (0.4-0.9 s for the audit's schema; ~1.3 ms for this one, 60
    times what a copy of a pristine matcher that kept its mask takes)."""
    constraint = schema(optional(480))
    compiler.guide(constraint)  # compiled and checked
    built = grammar_module.llguidance.LLMatcher(
        compiler.tokenizer, grammar_module.to_llguidance(constraint), limits=grammar_module._LIMITS
    )
    built.deep_copy().compute_bitmask()  # what the old start check did
    started = time.thread_time()
    built.deep_copy().compute_bitmask()
    recomputed = time.thread_time() - started
    copies = []
    for _ in range(5):
        guide = compiler.guide(constraint)
        row = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)
        started = time.thread_time()
        guide.fill(row.data_ptr(), row.numel() * 4)
        copies.append(time.thread_time() - started)
        assert not guide.error and int(row.count_nonzero()) > 0
    assert min(copies) < recomputed / 4, (copies, recomputed)


def test_a_grammar_found_too_costly_part_way_ends_its_request_and_is_refused_from_then_on(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """A free string first, then the audit's multiplying ``allOf``: the first token is cheap (so
    it compiles), the point after "a" costs 0.4 s a mask and overflows the parser. The request
    that gets there ends naming its field; the grammar is refused to every later request at
    once, which no longer pays the same stall."""
    hostile = {
        "type": "object",
        "properties": {"x": {"type": "string"}, "a": allof_of_anyofs(3, 12)},
        "required": ["x", "a"],
    }
    constraint = schema(hostile)
    first, beside = compiler.guide(constraint), compiler.guide(constraint)
    met = write(tokenizer, first, '{"x": "hi", "a": {"a0_1": 3}}')
    assert len(met) == 1, met
    reason = met[0].reason if isinstance(met[0], RowFault) else met[0]
    assert "cannot go on" in reason, reason
    if isinstance(met[0], RowFault):
        assert met[0].invalid_field == "json_schema"
    # Another request already following it stops at its next mask, without computing it.
    started = time.thread_time()
    faults = apply_guides(torch.zeros(1, VOCAB), [beside])
    assert time.thread_time() - started < 0.05
    assert faults[0].invalid_field == "json_schema"
    caught = refusal(compiler, constraint)
    assert caught.field == "json_schema" and "refused on this replica" in str(caught), str(caught)


def test_a_parser_overflow_part_way_is_said_plainly_and_refuses_the_grammar(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """Nested twenty objects of 25 optional properties: the row overflow comes when the token
    after "a" is consumed (the mask does not check it), with llguidance's own words before."""
    hostile = {
        "type": "object",
        "properties": {"x": {"type": "string"}, "a": {"anyOf": [optional(25, f"o{j}_") for j in range(20)]}},
        "required": ["x", "a"],
    }
    constraint = schema(hostile)
    guide = compiler.guide(constraint)
    met = write(tokenizer, guide, '{"x": "hi", "a": {"o0_1": 3}}')
    assert len(met) == 1 and isinstance(met[0], str), met
    assert "too many alternatives at one point" in met[0] and "Current row" not in met[0], met[0]
    assert "too many alternatives" in str(refusal(compiler, constraint))


def test_ordinary_constraints_still_compile_and_are_written(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    cases = [
        (schema(person), '{"name": "Ada", "age": 36}'),
        (Constraint(ConstraintKind.JSON_OBJECT), '{"a": [1, 2]}'),
        (Constraint(ConstraintKind.REGEX, "(.|\n)*"), "free text, any of it\n"),
        (Constraint(ConstraintKind.REGEX, "a*"), "aaa"),
        (Constraint(ConstraintKind.CHOICE, choices=("yes", "no")), "no"),
        (Constraint(ConstraintKind.GRAMMAR, 'start: "x" %json {"type": "integer"}'), "x42"),
    ]
    for constraint, text in cases:
        guide = compiler.guide(constraint)
        assert write(tokenizer, guide, text) == [], (constraint, text)
        assert guide.matcher.is_accepting(), (constraint, text)
