"""Output constraints compiled to token-level guides, with llguidance (docs/inference.md says why).

A ``Constraint`` (JSON schema, any JSON object, regex, grammar, choice) becomes an
llguidance grammar, checked against this model's tokenizer once and cached by a hash
of the constraint: the grammar compiler keeps one pristine matcher per grammar and
every request gets a deep copy, so a hot schema costs a copy, not a compile. Compiling
runs on whatever thread asks: the async front asks at admission
(``AsyncEngine.generate``), a new grammar on its one compiler thread, never from the
engine's step loop.

A ``Guide`` is one request's matcher: it fills that request's row of the step's token
bitmask and consumes each drawn token. Resumed tokens are replayed through it when it
is made, so a failed-over request continues its grammar exactly where it was.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from typing import Any

import llguidance
import llguidance.gbnf_to_lark
import llguidance.hf

from services.common.errors import InvalidArgument
from services.inference.sampling import Constraint, ConstraintKind

log = logging.getLogger("llmmesh.inference.grammar")

#: Grammars kept compiled (least recently used dropped first).
CACHE_SIZE = 256
#: JSON the model writes: one space after ':' and ',', none elsewhere. Flexible whitespace lets a
#: small greedy model pad with newlines until max_tokens; compact JSON is what parsers expect.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Recent compile times (ms), for the benchmark's p95 and the logs.
COMPILE_HISTORY = 1024
#: A JSON schema's budget, checked before it is compiled, since nothing stops a compile once it
#: runs (llguidance's parser limits bound matching, not building). OpenAI's own bound on
#: structured outputs is 5,000 properties (≈ 0.4 s here); a schema's ``patternProperties``
#: cost grows with the cube of their number: 64 compile in 16-26 ms, 128 in 0.13 s, 250 in
#: 1.5 s, 400 (15 KB of schema) in 29 s, measured 2026-12-07 with SmolLM2's vocabulary.
MAX_SCHEMA_PROPERTIES = 5000
MAX_SCHEMA_PATTERN_PROPERTIES = 64
#: Errors without the grammar and parser state: a refused token's message goes to the client.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class Guide:
    """One request's position in its grammar: which tokens may come next."""

    def __init__(self, matcher: llguidance.LLMatcher, field: str) -> None:
        self.matcher = matcher
        #: The request field the constraint came from, named when it cannot go on.
        self.field = field

    def fill(self, bitmask_row_ptr: int, nbytes: int) -> None:
        """Write the allowed next tokens into one bitmask row (a 32-bit word per 32 tokens)."""
        self.matcher.unsafe_compute_mask_ptr(bitmask_row_ptr, nbytes)

    def advance(self, token: int) -> str:
        """Consume a drawn token: "" when taken, else why the grammar refused it. The mask makes a
        refusal impossible but for a token past the grammar's end (``finished``), which is ignored."""
        if self.finished or self.matcher.consume_token(token):
            return ""
        return f"the output constraint refused token {token}: {self.error}"

    @property
    def finished(self) -> bool:
        """The grammar is complete and can take nothing more (end-of-sequence aside)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())


class GrammarCompiler:
    """Constraints to guides for one tokenizer; thread-safe, cached by the constraint's hash."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
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

        Raises ``InvalidArgument`` naming the constraint's field when it does not compile, and
        naming ``resume_token_ids`` when the resumed tokens are not a prefix the grammar allows.
        """
        matcher = self._pristine(constraint).deep_copy()
        if resume_token_ids and not matcher.consume_tokens(list(resume_token_ids)):
            raise InvalidArgument(
                "resume_token_ids",
                f"the resumed tokens do not follow the {constraint.kind.value} constraint: "
                f"{matcher.get_error()}",
            )
        return Guide(matcher, constraint.kind.value)

    def is_compiled(self, constraint: Constraint) -> bool:
        """Whether ``constraint``'s grammar is in the cache (a guide for it is a copy, not a compile)."""
        with self._lock:
            return _key(constraint) in self._cache

    def _pristine(self, constraint: Constraint) -> llguidance.LLMatcher:
        key = _key(constraint)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        started = time.perf_counter()
        grammar = to_llguidance(constraint)
        # One build: the matcher's own error is validate_grammar's message (checked), and a
        # separate validation compiled every grammar twice.
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, limits=_LIMITS)
        if matcher.is_error():
            raise InvalidArgument(constraint.kind.value, f"does not compile: {matcher.get_error().strip()}")
        _check_can_start(matcher, constraint)
        self.compile_ms.append((time.perf_counter() - started) * 1000.0)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher


#: A GBNF rule: a name and ``::=`` starting a line. Lark has no ``::=`` outside a string, but
#: a Lark grammar may hold one in a literal (``start: "x ::= y"``), which is no GBNF.
_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)


def _key(constraint: Constraint) -> str:
    return hashlib.sha256(json.dumps(constraint.key).encode()).hexdigest()


def _check_schema_budget(schema: Any, field: str) -> None:
    """``InvalidArgument`` for a schema whose compile would hold the replica's compiler for
    seconds to minutes (``MAX_SCHEMA_PROPERTIES``, ``MAX_SCHEMA_PATTERN_PROPERTIES``)."""
    properties = patterns = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                properties += len(node["properties"])
            if isinstance(node.get("patternProperties"), dict):
                patterns += len(node["patternProperties"])
            stack.extend(node.values())
    if properties > MAX_SCHEMA_PROPERTIES:
        raise InvalidArgument(field, f"at most {MAX_SCHEMA_PROPERTIES} properties in all, got {properties}")
    if patterns > MAX_SCHEMA_PATTERN_PROPERTIES:
        raise InvalidArgument(
            field, f"at most {MAX_SCHEMA_PATTERN_PROPERTIES} patternProperties in all, got {patterns}"
        )


def _check_can_start(matcher: llguidance.LLMatcher, constraint: Constraint) -> None:
    """``InvalidArgument`` when no token of this vocabulary can begin the constraint's output.

    A grammar can compile yet need bytes the vocabulary never writes (SmolLM2's tokenizer has
    no token for most C0 control characters): refused here, once per grammar, rather than
    failing the request at its first step. A dead end further in (after a prefix that can be
    written) ends that request alone with FINISH_REASON_ERROR, saying so.
    """
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        reason = probe.get_error().strip().splitlines()[0]
        raise InvalidArgument(
            constraint.kind.value, f"no token of this model's vocabulary can begin its output ({reason})"
        )


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
    return str(llguidance.LLMatcher.grammar_from_lark(text))
