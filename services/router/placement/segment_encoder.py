"""Tokenizes a rendered chat one special-token-delimited segment at a time, remembering segments.

A fast (Rust) tokenizer first cuts its input at its added tokens (``<|im_start|>``, …) and
tokenizes the pieces between them independently; each chat message is such a piece. Doing the
same cut here and caching each piece's ids gives the same ids as encoding the whole text,
and a long system prompt or RAG context shared by many requests is tokenized once: the
tokenizer itself costs ≈ 15 µs a token on a busy 2-vCPU VM (≈ 32 ms for 2,150 tokens), far over
the router's 2 ms budget per placement (docs/benchmarks.md, *Prefix hashes*).

The cut is only equivalent for added tokens matched verbatim (no ``lstrip``/``rstrip``/
``single_word``, and no normalizer that could change the text first); any other tokenizer is
encoded whole (``exact`` is False).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Distinct segments remembered (a system prompt, a RAG context, a question each count one).
CACHE_SEGMENTS = 4096
#: Longer segments are tokenized each time, not remembered: the cache is bounded by count, and
#: 4,096 segments of megabytes (prompts the replica then refused) grew the router by ~75 MiB
#: each. 16,384 characters is far over a shared system prompt or RAG context (8,192 here).
MAX_CACHED_SEGMENT_CHARS = 16_384


def _plain_added_tokens(tokenizer: Any) -> dict[str, int] | None:
    """content -> id of every added token, if each is matched verbatim; else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if backend is None or decoder is None or backend.normalizer is not None:
        return None
    added: dict[str, int] = {}
    for token_id, token in decoder.items():
        if token.lstrip or token.rstrip or token.single_word:
            return None
        added[str(token.content)] = int(token_id)
    return added


class SegmentEncoder:
    """``encode(text)`` == ``tokenizer.encode(text, add_special_tokens=False)``, segment-cached."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, cache_segments: int = CACHE_SEGMENTS) -> None:
        self.tokenizer = tokenizer
        added = _plain_added_tokens(tokenizer)
        #: Segment-wise encoding is known equivalent for this tokenizer.
        self.exact = bool(added)
        self._added = added or {}
        # Longest first: at one position the longest added token wins, as the tokenizer's matcher does.
        alternatives = sorted(self._added, key=len, reverse=True)
        self._cut = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None
        self._segment = functools.lru_cache(maxsize=cache_segments)(self._encode_segment)

    def _encode_segment(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        if self._cut is None or not self.exact:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        ids: list[int] = []
        for i, part in enumerate(self._cut.split(text)):
            if i % 2:  # the cut's capture group: an added token
                ids.append(self._added[part])
            elif len(part) > MAX_CACHED_SEGMENT_CHARS:
                ids.extend(self._encode_segment(part))
            elif part:
                ids.extend(self._segment(part))
        return ids
