"""Content words of a query: what keyword search and the reranker's name matching look at."""

from __future__ import annotations

import re

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


def content_words(text: str) -> list[str]:
    """``text``'s words, lower-cased, stop words left out, in order."""
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


def keyword_query(text: str) -> str:
    """The query BM25 reads: its content words (the query itself when it has none)."""
    return " ".join(content_words(text)) or text
