"""What a semantic-cache entry is scoped to: everything about the question except its last user message.

The retriever matches only entries with the same (tenant, model, fingerprint); the
router makes that fingerprint the whole question's: the sampling parameters, a
hash of every message before the last user one (system prompt, history, the RAG
context as it was put in the prompt), the versions of the documents that context
came from, and, for a question about the asker ("my order"), who asked. Only the
last user message is then compared by similarity.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence

# Bumped when the recipe changes, so entries stored under the old one are never found again.
SCOPE_VERSION = "s1"
# The asker's own things: "my order", "our invoices", "on file for me", "am I", "do I have".
# A bare "me" is not enough: "show me how", "repeat after me" ask nothing about the asker.
_PERSONAL = re.compile(
    r"\b(my|mine|our|ours)\b|\b(for|to|about|of|with) (me|us)\b|\bam i\b"
    r"|\b(do|did|have|can|should|will) i have\b|\bi (have|had|ordered|bought|paid|owe|got)\b",
    re.IGNORECASE,
)


def is_personal(text: str) -> bool:
    """Whether a question asks about the asker's own data, so its answer is theirs alone.

    A first-person possessive is enough: "how do I reset my password" is scoped to
    its user too, which costs a shared hit, never a wrong one.
    """
    return _PERSONAL.search(text) is not None


def last_user_index(messages: Sequence[tuple[str, str]]) -> int:
    """Where the last user message is (the one compared by similarity); the last message if none."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i][0] == "user":
            return i
    return len(messages) - 1


def scope_fingerprint(
    sampling_fingerprint: str,
    messages: Sequence[tuple[str, str]],
    cited: Sequence[tuple[str, int]] = (),
    user: str | None = None,
    cache_salt: str = "",
) -> str:
    """The retriever's ``params_fingerprint`` for this question: equal only for the same whole question.

    ``cited`` are the (document id, version) pairs the RAG context came from: a new
    version scopes a new question, even where its chunk text did not change.
    ``user`` is set for a personal question; None shares the entry across the tenant.
    ``cache_salt``: the turn's ``ChatRequest.cache_salt``; a salted question matches only its salt's.
    """
    last = last_user_index(messages)
    doc = {
        "v": SCOPE_VERSION,
        "sampling": sampling_fingerprint,
        "before": [list(m) for m in messages[:last]],
        "after": [list(m) for m in messages[last + 1 :]],
        "cited": sorted([d, v] for d, v in cited),
        "user": user,
    }
    if cache_salt:  # absent when unsalted: every entry stored before keeps its fingerprint
        doc["salt"] = cache_salt
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return f"{SCOPE_VERSION}:{digest}"
