"""Content words of a query, and text as keyword search indexes it: what BM25 and the reranker's
name matching look at.

Milvus Lite's analyzer splits on ``\\w+`` and a Milvus server's on Unicode word boundaries, so
before any text reaches either it is made comparable here, the same way for chunks and queries:

- NFKC: "café" typed precomposed (NFC) and decomposed (NFD, as macOS file names and some editors
  give it) are one word, and so are a PDF's ligatures ("ﬁ") and full-width letters and digits
  ("ＧＰＵ") and their plain forms;
- invisible characters that split a word for the analyzer but not for a reader go: zero-width
  space and joiners, word joiner, soft hyphen, byte-order mark, bidirectional marks;
- Chinese, Japanese and Korean are written without spaces between words, so a whole run of them
  would be one "word" that only the identical run matches ("数据库" never found "…嵌入向量数据库");
  each run is indexed as its characters and overlapping pairs of characters (the bigrams of
  Lucene's CJK analyzer), so any word of two or more characters matches where it occurs, and a
  one-character query still matches;
- Thai, Lao, Khmer and Myanmar are written without spaces between words too (a space ends a
  phrase), and no segmenting dictionary ships with the retriever: each run is indexed as its
  overlapping pairs of code points, so a query word of two or more code points matches where it
  occurs inside a run. Single code points are left out: many are vowel signs and tone marks,
  which alone match nearly every run.
"""

from __future__ import annotations

import re
import unicodedata

# Words too common to tell two documents apart. Milvus Lite 3.2's analyzer accepts a stop filter
# but does not apply it (measured: "what" still matches), so queries drop these themselves.
STOPWORDS = frozenset(
    [
        "a",
        "about",
        "an",
        "and",
        "any",
        "are",
        "as",
        "at",
        "be",
        "been",
        "by",
        "can",
        "could",
        "did",
        "do",
        "does",
        "for",
        "from",
        "had",
        "has",
        "have",
        "how",
        "i",
        "if",
        "in",
        "into",
        "is",
        "it",
        "its",
        "me",
        "my",
        "of",
        "on",
        "or",
        "our",
        "should",
        "so",
        "than",
        "that",
        "the",
        "their",
        "them",
        "there",
        "these",
        "they",
        "this",
        "those",
        "to",
        "us",
        "was",
        "we",
        "were",
        "what",
        "when",
        "where",
        "which",
        "who",
        "whom",
        "whose",
        "why",
        "will",
        "with",
        "would",
        "you",
        "your",
    ]
)
_WORD = re.compile(r"\w+")
# Zero-width space, non-joiner and joiner, bidirectional marks, embeddings and isolates, word
# joiner and invisible operators, Arabic letter mark, byte-order mark, soft hyphen.
_INVISIBLE = re.compile("[\u00ad\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]")
# Scripts written without spaces between words: Hiragana, Katakana, CJK ideographs (with
# extensions A-H and the compatibility block), Hangul syllables (Korean spaces phrases, not words).
_CJK_RUN = re.compile(
    "[\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\U00020000-\U0003ffff]+"
)


# Thai, Lao, Myanmar (with extensions A and B) and Khmer (with its symbols).
_SOUTHEAST_ASIAN_RUN = re.compile(
    "[\u0e00-\u0e7f\u0e80-\u0eff\u1000-\u109f\ua9e0-\ua9ff\uaa60-\uaa7f\u1780-\u17ff\u19e0-\u19ff]+"
)


def normalized(text: str) -> str:
    """``text`` as keyword search compares it: NFKC, invisible characters removed."""
    return _INVISIBLE.sub("", unicodedata.normalize("NFKC", text))


def _cjk_terms(match: re.Match[str]) -> str:
    run = match.group()
    grams = [*run, *(run[i : i + 2] for i in range(len(run) - 1))]
    return " " + " ".join(grams) + " "


def _pair_terms(match: re.Match[str]) -> str:
    run = match.group()
    if len(run) < 2:
        return f" {run} "
    return " " + " ".join(run[i : i + 2] for i in range(len(run) - 1)) + " "


def keyword_text(text: str) -> str:
    """``text`` as it is keyword-indexed: normalized, each CJK run as its characters and bigrams,
    each Thai, Lao, Khmer or Myanmar run as its bigrams."""
    return _SOUTHEAST_ASIAN_RUN.sub(_pair_terms, _CJK_RUN.sub(_cjk_terms, normalized(text)))


def content_words(text: str) -> list[str]:
    """``text``'s words, normalized and lower-cased, stop words left out, in order."""
    return [w for w in _WORD.findall(normalized(text).lower()) if w not in STOPWORDS]


def keyword_query(text: str) -> str:
    """The query BM25 reads: its content words (the query itself when it has none), indexed as
    chunks are (``keyword_text``)."""
    return keyword_text(" ".join(content_words(text)) or text)
