"""Output constraints compiled to token-level guides, with llguidance (docs/inference.md says why).

A ``Constraint`` (JSON schema, any JSON object, regex, grammar, choice) becomes an
llguidance grammar, checked against this model's tokenizer once and cached by a hash
of the constraint: the grammar compiler keeps one pristine matcher per grammar and
every request gets a deep copy, so a hot schema costs a copy, not a compile. Compiling
runs on whatever thread asks: the async front asks at admission
(``AsyncEngine.generate``), a new grammar on its one compiler thread, never from the
engine's step loop. A constraint refused there is remembered too, so a repeat is
refused at once instead of compiled again.

Every step's token masks are computed on the engine thread, where each one holds up the
whole batch: so a grammar is checked at compile for what its first token costs (its mask,
computed on the pristine matcher, which every copy then reuses; every token that mask allows
consumed once), and a guide that later finds its grammar too costly (one mask over
``MAX_MASK_MS``, or llguidance's parser limits) ends its request and gets the grammar refused
from then on.

A ``Guide`` is one request's matcher: it fills that request's row of the step's token
bitmask and consumes each drawn token. Resumed tokens are replayed through it when it
is made, so a failed-over request continues its grammar exactly where it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import llguidance
import llguidance.gbnf_to_lark
import llguidance.hf
import numpy as np

from services.common.errors import InvalidArgument
from services.inference.sampling import Constraint, ConstraintKind

log = logging.getLogger("llmmesh.inference.grammar")

#: Grammars kept compiled (least recently used dropped first).
CACHE_SIZE = 256
#: Constraints kept refused (least recently used dropped first): a refusal found by compiling is
#: not paid again (a schema that overflows llguidance's symbol table compiles for 0.7-2.7 s before
#: it fails, and each repeat cost the compiler thread as much again).
REFUSED_CACHE_SIZE = 256
#: JSON the model writes: one space after ':' and ',', none elsewhere. Flexible whitespace lets a
#: small greedy model pad with newlines until max_tokens; compact JSON is what parsers expect.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Recent compile times (ms), for the benchmark's p95 and the logs.
COMPILE_HISTORY = 1024
#: A JSON schema's budget (a ``json_schema``, or every ``%json`` a grammar embeds), checked
#: before it is compiled, since nothing stops a compile once it runs (llguidance's parser limits
#: bound matching, not building). OpenAI's own bound on structured outputs is 5,000 properties
#: (0.4-0.65 s to compile here: 5,000 required in one object, 50 objects of 100 optional, 10 of
#: 490 optional); a schema's ``patternProperties`` cost grows with the cube of their number: 64
#: compile in 16-26 ms, 128 in 0.13 s, 250 in 1.5 s, 400 (15 KB of schema) in 29 s, measured
#: 2026-12-07 with SmolLM2's vocabulary.
MAX_SCHEMA_PROPERTIES = 5000
MAX_SCHEMA_PATTERN_PROPERTIES = 64
#: Optional properties (not in ``required``) of one object. Where every property of an object
#: is optional, each of them can come next: llguidance's parser holds ~4 items per property at
#: that point and refuses a point past 2,000 items, so 499 optional properties compiled and then
#: failed at the request's first token ("Current row has 2003 items; max is 2000"; 498 was the
#: most that worked; 600 needed 2,407 items, 5,000 compiled for 4.5 s first). One required
#: property among them does not save it: with 1,000 optional properties and one required, the
#: point after the first property needed 3,001 items. 490 leaves a margin under 498.
MAX_OPTIONAL_PROPERTIES = 490
#: The most one token mask may take (ms of the thread's CPU time, ``time.thread_time``: a mask
#: that waited for the GIL or for a core is not counted against its grammar). Masks are computed
#: on the engine thread, inside the step, so every other request waits for each one. The slowest
#: that legitimate grammars took here were 0.1-3.8 ms for JSON schemas within the budget above,
#: 7-9 ms for a 1,000-keyword Lark grammar's first mask and 2.5-5.5 ms for character-level ones
#: (at llguidance's 50,000-item step limit); a 2.4 KB ``allOf`` of three ``anyOf``s of 12 objects
#: took 400-570 ms at its first token, on every request (the neighbours' streams stalled 0.9 s a
#: token). Checked for the first token at compile (on the compiler thread) and by every guide
#: after (which then ends its request and gets the grammar refused).
MAX_MASK_MS = 100.0
#: The most checking a grammar's first tokens may take at compile (s of CPU time): each token its
#: start mask allows is consumed once, on a copy (49,061 tokens of a free-text grammar took 92 ms;
#: 1,494 of a 1,000-keyword grammar 4-17 ms).
MAX_START_CHECK_S = 2.0
#: Errors without the grammar and parser state: a refused token's message goes to the client.
#: ``step_max_items`` is llguidance's default, written out: it bounds one mask's walk over the
#: vocabulary's trie (50,000 items took 2.5-5.5 ms here before the mask failed; 10,000 took
#: 0.8-2.1 ms), so a lower one would only fail more character-level grammars sooner. It does not
#: bound one oversized parser row, which is built whole before any limit is checked (with 5,000
#: the ``allOf`` above still took 405 ms): ``MAX_MASK_MS`` and the start check catch those.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False, step_max_items=50_000)
#: llguidance's row limit, as its parser words it (on the token that reaches such a point).
_ROW_LIMIT = re.compile(r"Current row has (\d+) items; max is (\d+)")


class _Compiled:
    """A compiled grammar: its pristine matcher (the start mask computed, which copies reuse),
    and why it is refused if a request's guide found it too costly after it compiled."""

    __slots__ = ("_on_refused", "matcher", "refusal")

    def __init__(self, matcher: llguidance.LLMatcher, on_refused: Callable[[str], None]) -> None:
        self.matcher = matcher
        #: Set once (a plain attribute: its guides read it every step, without a lock).
        self.refusal = ""
        self._on_refused = on_refused

    def refuse(self, reason: str) -> None:
        if not self.refusal:
            self.refusal = reason
            self._on_refused(reason)


class Guide:
    """One request's position in its grammar: which tokens may come next."""

    def __init__(self, matcher: llguidance.LLMatcher, field: str, grammar: _Compiled | None = None) -> None:
        self.matcher = matcher
        #: The request field the constraint came from, named when it cannot go on.
        self.field = field
        self._grammar = grammar
        #: Why this guide stopped although its matcher did not fail (``MAX_MASK_MS``).
        self._refusal = ""

    def fill(self, bitmask_row_ptr: int, nbytes: int) -> None:
        """Write the allowed next tokens into one bitmask row (a 32-bit word per 32 tokens).

        A grammar another request found too costly is not followed further (``error`` says
        why, and the row is left as it is); a mask over ``MAX_MASK_MS``, or one past llguidance's
        parser limits, ends this request and gets its grammar refused from then on.
        """
        grammar = self._grammar
        if grammar is not None and grammar.refusal:
            self._refusal = grammar.refusal
            return
        started = time.thread_time()
        self.matcher.unsafe_compute_mask_ptr(bitmask_row_ptr, nbytes)
        took_ms = (time.thread_time() - started) * 1000.0
        if took_ms > MAX_MASK_MS:
            self._give_up(f"one token's mask took {took_ms:.0f} ms ({_MASK_BOUND})")
        elif self.matcher.is_error() and (reason := _too_complex(self.matcher.get_error())):
            self._give_up(reason)

    def advance(self, token: int) -> str:
        """Consume a drawn token: "" when taken, else why the grammar refused it. The mask makes a
        refusal impossible but for a token past the grammar's end (``finished``), which is ignored,
        or one that takes the parser past its row limit (the mask does not check that)."""
        if self.finished or self.matcher.consume_token(token):
            return ""
        reason = _too_complex(self.matcher.get_error())
        if reason:
            self._give_up(reason)
            return f"the output constraint cannot go on after token {token}: {reason}"
        return f"the output constraint refused token {token}: {self.error}"

    @property
    def finished(self) -> bool:
        """The grammar is complete and can take nothing more (end-of-sequence aside)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return self._refusal or str(self.matcher.get_error())

    def _give_up(self, reason: str) -> None:
        self._refusal = reason
        if self._grammar is not None:
            self._grammar.refuse(reason)


class GrammarCompiler:
    """Constraints to guides for one tokenizer; thread-safe, cached by the constraint's hash."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, _Compiled] = OrderedDict()
        #: Refused constraints: their field and the refusal (``REFUSED_CACHE_SIZE``).
        self._refused: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self.compile_ms: deque[float] = deque(maxlen=COMPILE_HISTORY)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (every token's bytes): ~1 s to build, so built on
        the first constrained request (on the admission executor), not at every engine start."""
        with self._lock:
            if self._tokenizer is None:
                started = time.perf_counter()
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, self.vocab_size)
                log.info("grammar tokenizer ready in %.2fs", time.perf_counter() - started)
            return self._tokenizer

    def guide(self, constraint: Constraint, resume_token_ids: Seq[int] = ()) -> Guide:
        """A fresh guide for ``constraint`` that has consumed ``resume_token_ids``.

        Raises ``InvalidArgument`` naming the constraint's field when it does not compile (or was
        refused before), and naming ``resume_token_ids`` when the resumed tokens are not a prefix
        the grammar allows.
        """
        grammar = self._compiled(constraint)
        matcher = grammar.matcher.deep_copy()
        if resume_token_ids and not matcher.consume_tokens(list(resume_token_ids)):
            raise InvalidArgument(
                "resume_token_ids",
                f"the resumed tokens do not follow the {constraint.kind.value} constraint: "
                f"{matcher.get_error()}",
            )
        return Guide(matcher, constraint.kind.value, grammar)

    def is_compiled(self, constraint: Constraint) -> bool:
        """Whether a guide for ``constraint`` needs no compile: its grammar is in the cache (a
        guide is a copy), or it was refused (and is refused again at once)."""
        key = _key(constraint)
        with self._lock:
            return key in self._cache or key in self._refused

    def _compiled(self, constraint: Constraint) -> _Compiled:
        key = _key(constraint)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            refused = self._refused.get(key)
            if refused is not None:
                self._refused.move_to_end(key)
                raise InvalidArgument(*refused)
        started = time.perf_counter()
        try:
            matcher = self._build(constraint)
        except InvalidArgument as exc:
            self._remember_refusal(key, exc.field, str(exc).removeprefix(f"{exc.field}: "))
            raise
        self.compile_ms.append((time.perf_counter() - started) * 1000.0)
        field = constraint.kind.value
        grammar = _Compiled(matcher, lambda reason: self._refuse_compiled(key, field, reason))
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The pristine matcher for ``constraint``, its start checked (``_check_start``)."""
        field = constraint.kind.value
        grammar = to_llguidance(constraint)
        # One build: the matcher's own error is validate_grammar's message (checked), and a
        # separate validation compiled every grammar twice.
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, limits=_LIMITS)
        if matcher.is_error():
            raise InvalidArgument(field, _compile_error(matcher.get_error()))
        _check_start(matcher, field, self.vocab_size)
        return matcher

    def _remember_refusal(self, key: str, field: str, problem: str) -> None:
        with self._lock:
            self._refused[key] = (field, problem)
            self._refused.move_to_end(key)
            while len(self._refused) > REFUSED_CACHE_SIZE:
                self._refused.popitem(last=False)

    def _refuse_compiled(self, key: str, field: str, reason: str) -> None:
        """A request's guide found the compiled grammar too costly: refused from now on."""
        log.warning("output constraint refused after it compiled: %s", reason)
        with self._lock:
            self._cache.pop(key, None)
        self._remember_refusal(
            key, field, f"refused on this replica: a request with it could not go on: {reason}"
        )


#: A GBNF rule: a name and ``::=`` starting a line. Lark has no ``::=`` outside a string, but
#: a Lark grammar may hold one in a literal (``start: "x ::= y"``), which is no GBNF.
_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)


def _key(constraint: Constraint) -> str:
    return hashlib.sha256(json.dumps(constraint.key).encode()).hexdigest()


def _check_schema_budget(schemas: Any, field: str) -> None:
    """``InvalidArgument`` for a schema (or a list of them, counted together) whose compile would
    hold the replica's compiler for seconds to minutes (``MAX_SCHEMA_PROPERTIES``,
    ``MAX_SCHEMA_PATTERN_PROPERTIES``) or that could not write its output once compiled
    (``MAX_OPTIONAL_PROPERTIES``)."""
    properties = patterns = 0
    stack = [schemas]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                properties += len(props)
                required = node.get("required")
                named = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
                optional = sum(1 for name in props if name not in named)
                if optional > MAX_OPTIONAL_PROPERTIES:
                    raise InvalidArgument(
                        field,
                        f"too many optional properties in one object: at most {MAX_OPTIONAL_PROPERTIES} "
                        f"that are not in its required list, got {optional} (llguidance's parser "
                        "could not write the object's next property)",
                    )
            if isinstance(node.get("patternProperties"), dict):
                patterns += len(node["patternProperties"])
            stack.extend(node.values())
    if properties > MAX_SCHEMA_PROPERTIES:
        raise InvalidArgument(field, f"at most {MAX_SCHEMA_PROPERTIES} properties in all, got {properties}")
    if patterns > MAX_SCHEMA_PATTERN_PROPERTIES:
        raise InvalidArgument(
            field, f"at most {MAX_SCHEMA_PATTERN_PROPERTIES} patternProperties in all, got {patterns}"
        )


#: JSON values, as Lark's ``%json`` reads them: integers kept as text (no digit limit to trip on).
_JSON_VALUE = json.JSONDecoder(parse_int=str)
#: ``%json`` in one grammar's text (OpenAI's bound on tools, each of which a tool-calling grammar
#: may embed): each is read as JSON to its end or its first error, so the text is read at most
#: this many times over.
MAX_EMBEDDED_SCHEMAS = 128


def _embedded_schemas(lark: str, field: str) -> list[Any]:
    """Every JSON schema a Lark grammar embeds (``name: %json {...}``).

    Every ``%json`` in the text counts, also one inside a string literal or a comment (which
    llguidance does not compile): counting too much refuses only a grammar that writes a huge
    schema into its own text, while a reader that missed one would let it compile unbudgeted.
    Text after a ``%json`` that is no JSON is skipped (llguidance refuses the grammar if it
    meant one there), and the search goes on from there: a failed read cannot hide a real
    ``%json`` further on (one inside a JSON string that a decoy opened, say).
    """
    if lark.count("%json") > MAX_EMBEDDED_SCHEMAS:
        raise InvalidArgument(
            field, f"at most {MAX_EMBEDDED_SCHEMAS} %json schemas, got {lark.count('%json')}"
        )
    schemas: list[Any] = []
    at = lark.find("%json")
    while at >= 0:
        begin = at + len("%json")
        while begin < len(lark) and lark[begin] in " \t\r\n":  # serde_json's whitespace
            begin += 1
        # No JSON here, or nested past serde_json's 128 levels (which llguidance refuses too).
        with contextlib.suppress(ValueError, RecursionError):
            schema, begin = _JSON_VALUE.raw_decode(lark, begin)
            schemas.append(schema)  # and read on after it: each character is read once
        at = lark.find("%json", begin)
    return schemas


#: What a refusal over ``MAX_MASK_MS`` says about the bound.
_MASK_BOUND = f"at most {MAX_MASK_MS:.0f} ms: every request on this replica waits for each one"


def _too_complex(error: str) -> str:
    """Why llguidance's parser gave up at some point of the output, in a client's words; "" for
    any other error (a token the grammar refuses, a dead end)."""
    row = _ROW_LIMIT.search(error)
    if row is not None:
        return (
            f"too many alternatives at one point of the output ({row[1]} parser items; llguidance "
            f"allows {row[2]}): more than {MAX_OPTIONAL_PROPERTIES} optional properties open at once, "
            "or anyOf/oneOf/allOf branches that multiply"
        )
    if "Too many items" in error:
        return f"too costly for llguidance's parser at one point ({_first_line(error)})"
    return ""


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else ""


def _compile_error(error: str) -> str:
    """llguidance's reason a grammar does not compile, without a panic's backtrace (its frames
    name the server's paths: 2.5 KB of them reached the client)."""
    text = error.split("<backtrace>", 1)[0].strip()
    if text.startswith("panic:"):
        if "symbols.len()" in text:  # an assertion on its 16-bit symbol ids
            return "schema too large: its grammar needs more symbols than llguidance allows (65,525)"
        return f"does not compile: llguidance failed on it ({_first_line(text)[:200]})"
    return f"does not compile: {text}"


def _check_start(matcher: llguidance.LLMatcher, field: str, vocab_size: int) -> None:
    """``InvalidArgument`` unless the constraint's first token can be written, cheaply.

    Runs on the compiler thread, once per grammar. The start mask is computed on the pristine
    matcher itself: llguidance keeps a computed mask with the matcher and ``deep_copy`` keeps
    it, so no request computes it again on the engine thread (a copy's first mask took 0-9 ms
    where the pristine's took 400 ms). Refused:

    - a start mask over ``MAX_MASK_MS`` (a grammar that costly at its start is as costly further
      on, on the engine thread);
    - a grammar no token of this vocabulary can begin (it needs bytes the vocabulary never
      writes: SmolLM2's tokenizer has no token for most C0 control characters);
    - one whose first token cannot be consumed: every token the mask allows is consumed once,
      on a copy, since llguidance checks its row limit only when a token is consumed ("Current
      row has 2003 items; max is 2000" failed requests at their first token).

    A dead end further in (after a prefix that can be written) ends that request alone with
    FINISH_REASON_ERROR, saying so.
    """
    started = time.thread_time()
    mask = matcher.compute_bitmask()
    took_ms = (time.thread_time() - started) * 1000.0
    if matcher.is_error():
        error = matcher.get_error()
        reason = _too_complex(error)
        if reason:
            raise InvalidArgument(field, f"cannot begin its output: {reason}")
        raise InvalidArgument(
            field, f"no token of this model's vocabulary can begin its output ({_first_line(error)})"
        )
    if took_ms > MAX_MASK_MS:
        raise InvalidArgument(
            field, f"too costly to follow: its first token's mask took {took_ms:.0f} ms ({_MASK_BOUND})"
        )
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab_size]
    probe = matcher.deep_copy()
    for token in np.flatnonzero(bits).tolist():
        began = time.thread_time()
        if probe.consume_token(token):
            taken = probe.rollback(1)
        else:
            reason = _too_complex(probe.get_error())
            if reason:
                raise InvalidArgument(field, f"cannot begin its output: {reason}")
            taken = False
        now = time.thread_time()
        if (now - began) * 1000.0 > MAX_MASK_MS:
            raise InvalidArgument(
                field,
                f"too costly to follow: its first token took {(now - began) * 1000.0:.0f} ms ({_MASK_BOUND})",
            )
        if now - started > MAX_START_CHECK_S:
            raise InvalidArgument(
                field, f"too costly to check: its possible first tokens took over {MAX_START_CHECK_S:.0f} s"
            )
        if not taken:  # refused for another reason (end-of-sequence, say): a fresh copy goes on
            probe = matcher.deep_copy()


def to_llguidance(constraint: Constraint) -> str:
    """The llguidance grammar for a constraint; ``InvalidArgument`` for text that is not even
    the right kind (a schema that is not JSON)."""
    kind = constraint.kind
    field = kind.value
    if kind is ConstraintKind.JSON_OBJECT:
        return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS))
    if kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(constraint.spec)
        except ValueError as exc:  # not JSON, or an integer past Python's 4,300-digit limit
            raise InvalidArgument(field, f"is not valid JSON: {exc}") from None
        except RecursionError:
            # Python's parser recurses per level; llguidance would refuse past 128 levels anyway.
            raise InvalidArgument(field, "is nested too deep to read") from None
        if not isinstance(schema, dict):
            raise InvalidArgument(field, "must be a JSON object")
        _check_schema_budget(schema, field)
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
        except ValueError as exc:
            raise InvalidArgument(field, str(exc)) from None
    if kind is ConstraintKind.REGEX:
        return str(llguidance.LLMatcher.grammar_from_regex(constraint.spec))
    if kind is ConstraintKind.CHOICE:
        # JSON string literals are Lark string literals: every choice quoted and escaped.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choices)
        return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"))
    text = constraint.spec
    if _GBNF_RULE.search(text):  # GBNF (llama.cpp's notation): llguidance translates it to Lark
        try:
            text = llguidance.gbnf_to_lark.gbnf_to_lark(text)
        except Exception as exc:  # its parser raises plain exceptions with the position
            raise InvalidArgument(field, f"is not valid GBNF: {exc}") from None
    # A grammar's %json schemas compile as a json_schema does: the same budget, over all of them
    # (400 patternProperties in a %json compiled for ~15 s where json_schema refused them).
    _check_schema_budget(_embedded_schemas(text, field), field)
    return str(llguidance.LLMatcher.grammar_from_lark(text))
