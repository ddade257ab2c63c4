"""The check after the vector match: does the cached question ask what the new one asks?

A semantic-cache candidate is served only when every check below agrees; the
first that refuses names the reason (the ``llmmesh_router_semantic_rejections_total``
label). The cheap checks each compare one feature that changes the answer; the
last, ``alignment``, is the stronger judgment: every content word of one question
must have a counterpart in the other (equal, same stem, one word in another spelling, or
a plausible typo of a known word: ``semantic_text.same_word``), so a
substituted word ("Django" for "Flask", "refund" for "exchange") refuses even
where no rule names it. It costs synonyms (measured in docs/benchmarks.md: the
paraphrase hit rate it gives up, against the false hits it prevents).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from services.router.turns.semantic_text import (
    ANTONYMS,
    CONNECTORS,
    NEGATING_PREFIXES,
    STOPWORDS,
    Question,
    same_word,
    stem,
)

# The cosine a cached question must reach before it is verified: lower than seed 000's 0.92,
# since the verifier, not the threshold, keeps wrong answers out (docs/benchmarks.md).
DEFAULT_CANDIDATE_THRESHOLD = 0.70
# Longer last messages skip the semantic cache: the direction check's cost grows with the
# square of the words (up to 130-190 ms at 1,000 characters in its worst case, on a worker
# thread: docs/retriever.md), and a long prompt is rarely asked twice in other words.
MAX_VERIFIED_CHARS = 1000
# Typo'd words a rephrasing may have per question (each is tested against every word).
MAX_TYPOS = 3
_ANTONYM_STEMS = tuple((stem(a), stem(b)) for a, b in ANTONYMS)
# In order: the first refusing check is the reason reported.
REASONS = (
    "numbers",
    "units",
    "time",
    "tense",
    "negation",
    "only",
    "asks",
    "modal",
    "particle",
    "choice",
    "direction",
    "entity",
    "alignment",
)


def check_numbers(query: Question, cached: Question) -> bool:
    return query.numbers == cached.numbers


def check_units(query: Question, cached: Question) -> bool:
    return query.units == cached.units


def check_time(query: Question, cached: Question) -> bool:
    return query.times == cached.times


def check_tense(query: Question, cached: Question) -> bool:
    """Where both ask with an auxiliary verb, in the same tense: "Is Pluto a planet?" is not
    "Was Pluto a planet?", "Did they win?" not "Will they win?". One without ("Who founded
    Apple?") is left to the other checks."""
    return not (query.tenses and cached.tenses) or query.tenses == cached.tenses


def check_only(query: Question, cached: Question) -> bool:
    """As many restricting words: "the only official language" is not "an official language"."""
    return query.restrictions == cached.restrictions


def check_negation(query: Question, cached: Question) -> bool:
    """As many negations on both sides, and no word swapped for its opposite ("excluded", "unsafe")."""
    if query.negations != cached.negations:
        return False
    mine = {stem(t) for t in query.tokens}
    theirs = {stem(t) for t in cached.tokens}
    only_mine, only_theirs = set(query.tokens) - set(cached.tokens), set(cached.tokens) - set(query.tokens)
    if _negated_across(only_mine, only_theirs) or _negated_across(only_theirs, only_mine):
        return False
    for sa, sb in _ANTONYM_STEMS:
        if (sa in mine and sb in theirs and sb not in mine) or (
            sb in mine and sa in theirs and sa not in mine
        ):
            return False
    return True


def check_asks(query: Question, cached: Question) -> bool:
    """Where both say what they ask for, the same: "who founded" is not "when was … founded",
    "how did … die" not "when did … die". One without a question word ("Apple's founding
    date?", "What killed Lincoln?": "what" asks for anything) is left to the other checks."""
    return not (query.asks and cached.asks) or query.asks == cached.asks


def check_modal(query: Question, cached: Question) -> bool:
    """Where both ask with a modal verb, the same kind: "can I take" is not "should I take"."""
    return not (query.modals and cached.modals) or query.modals == cached.modals


def check_particles(query: Question, cached: Question) -> bool:
    """No word followed by one particle here and another there: "sign in" / "sign up"."""
    mine, theirs = query.particles, cached.particles
    return all(theirs.get(word, particle) == particle for word, particle in mine.items())


def check_choice(query: Question, cached: Question) -> bool:
    """As many "or"s: "Python or Java" asks to choose, "Python and Java" does not."""
    return query.alternatives == cached.alternatives


def _negated_across(words: set[str], others: set[str]) -> bool:
    """Whether a word of ``words`` is one of ``others`` with a negating prefix ("unsafe" for "safe")."""
    for word in words:
        for prefix in NEGATING_PREFIXES:
            if word.startswith(prefix) and len(word) - len(prefix) >= 3 and word[len(prefix) :] in others:
                return True
    return False


def check_direction(query: Question, cached: Question) -> bool:
    """A shared word said with opposite directions, or two shared words swapped, refuse.

    "migrate to PostgreSQL" / "migrate from PostgreSQL" say opposite directions of one
    word. Two shared words in the opposite order refuse where the same word sits between
    them on both sides ("USD to EUR" / "EUR to USD" share "to"; "a guest invites the host"
    / "the host invites a guest" share "invite"), or where only the same stop words sit
    between them on both sides ("Is every square a rectangle?" / "Is every rectangle a
    square?"), unless those are "and" or "or" ("tea or coffee"), or where nothing else
    differs ("Are all doctors scientists?" / "Are all scientists doctors?"); with nothing
    between them and other words changed, the order may be a compound's ("reset
    password" / "do a password reset"). A clause moved to the front ("In Python, how
    do I…") keeps nothing in common between its words. Words said twice in a question
    have no one place, and are left out.
    """
    theirs = cached.directions
    if any(theirs.get(word, way) != way for word, way in query.directions.items()):
        return False
    q, c = _positions(query), _positions(cached)
    shared = [w for w in q if w in c]
    pivots = set(shared) | CONNECTORS
    swap = _pure_swap(query, cached)
    q_words, c_words = _words_before(query), _words_before(cached)
    for i, a in enumerate(shared):
        for b in shared[i + 1 :]:
            if (q[a] < q[b]) == (c[a] < c[b]):
                continue
            if _between(query, q[a], q[b], pivots) & _between(cached, c[a], c[b], pivots):
                return False
            gap = _gap(query, q_words, q[a], q[b])
            if gap in _SYMMETRIC_GAPS:
                continue  # "tea or coffee" is "coffee or tea"
            if gap and gap == _gap(cached, c_words, c[a], c[b]):
                return False  # "square a rectangle" / "rectangle a square"
            if swap == {a, b}:
                return False  # "doctors scientists" / "scientists doctors", all else equal
    return True


def check_entities(query: Question, cached: Question) -> bool:
    """Every name in either question is in the other (up to a typo): "Berlin" is not "Munich"."""
    names = query.names | cached.names
    return _all_have_counterparts(query.entities, cached.tokens, names) and _all_have_counterparts(
        cached.entities, query.tokens, names
    )


def check_alignment(query: Question, cached: Question) -> bool:
    """No content word of either question without a counterpart in the other."""
    names = query.names | cached.names
    return _all_have_counterparts(query.content, cached.content, names) and _all_have_counterparts(
        cached.content, query.content, names
    )


def _all_have_counterparts(words: Iterable[str], other: Sequence[str], names: frozenset[str]) -> bool:
    """Every word equal, same-stemmed or a typo of one of ``other``; the costly typo test comes last.

    More than ``MAX_TYPOS`` words without an equal is another question, not a typo'd
    one: refused at once, which also bounds the typo tests made per lookup.
    ``names`` are the words written only capitalised (``same_word``).
    """
    exact = set(other)
    stems = {stem(w) for w in exact}
    unmatched = [w for w in set(words) if w not in exact and stem(w) not in stems]
    if len(unmatched) > MAX_TYPOS:
        return False
    return all(any(same_word(word, candidate, names) for candidate in exact) for word in unmatched)


CHECKS: tuple[tuple[str, Callable[[Question, Question], bool]], ...] = (
    ("numbers", check_numbers),
    ("units", check_units),
    ("time", check_time),
    ("tense", check_tense),
    ("negation", check_negation),
    ("only", check_only),
    ("asks", check_asks),
    ("modal", check_modal),
    ("particle", check_particles),
    ("choice", check_choice),
    ("direction", check_direction),
    ("entity", check_entities),
    ("alignment", check_alignment),
)


def refusal(query: str, cached: str, checks: Sequence[str] = REASONS) -> str | None:
    """The first check (of ``checks``) that finds the two questions ask different things, or None."""
    q, c = Question(query), Question(cached)
    for name, check in CHECKS:
        if name in checks and not check(q, c):
            return name
    return None


def _positions(question: Question) -> dict[str, int]:
    """Stem -> position, for content words said once (a repeated word has no one place)."""
    stems = [stem(t) for t in question.tokens]
    counts = Counter(stems)
    content = set(question.content)
    return {
        s: i
        for i, (s, t) in enumerate(zip(stems, question.tokens, strict=True))
        if t in content and counts[s] == 1
    }


# Stop words between two neighbours whose order says nothing: "tea or coffee", "salt and pepper".
_SYMMETRIC_GAPS = {("and",), ("or",), ("and", "the"), ("or", "the"), ("and", "a"), ("or", "a")}
_SYMMETRIC_GAPS |= {("and", "an"), ("or", "an")}


def _words_before(question: Question) -> list[int]:
    """How many words that are no stop words come before each position (and one past the end)."""
    counts = [0]
    for token in question.tokens:
        counts.append(counts[-1] + (token not in STOPWORDS))
    return counts


def _gap(question: Question, words_before: list[int], i: int, j: int) -> tuple[str, ...] | None:
    """The words strictly between two positions, where all are stop words (else None)."""
    lo, hi = sorted((i, j))
    if words_before[hi] != words_before[lo + 1]:
        return None
    return question.tokens[lo + 1 : hi]


def _pure_swap(query: Question, cached: Question) -> set[str]:
    """The two stems exchanged where the two say the same words but for them ("Are all
    doctors scientists?" / "Are all scientists doctors?"), else an empty set."""
    mine, theirs = [stem(t) for t in query.tokens], [stem(t) for t in cached.tokens]
    if len(mine) != len(theirs):
        return set()
    differ = [i for i, (x, y) in enumerate(zip(mine, theirs, strict=True)) if x != y]
    if len(differ) != 2:
        return set()
    i, j = differ
    return {mine[i], mine[j]} if (mine[i], mine[j]) == (theirs[j], theirs[i]) else set()


def _between(question: Question, i: int, j: int, pivots: set[str]) -> set[str]:
    """The pivots (connectors, shared words said once) strictly between two positions."""
    lo, hi = sorted((i, j))
    found = {stem(w) for w in question.tokens[lo + 1 : hi] if stem(w) in pivots}
    return found | {w for w in question.tokens[lo + 1 : hi] if w in CONNECTORS}
