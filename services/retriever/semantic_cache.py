"""The semantic response cache: answers stored under their prompt's embedding, found again by similarity.

An entry is scoped to (tenant, model, sampling-parameter fingerprint): only a
lookup with the same three can find it. It lives ``ttl`` seconds (checked at
lookup; expired rows are purged lazily), and it records the version of every
document its answer cited, so re-ingesting one of those documents retires it.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument, NotFound
from services.retriever.corpus import TextEmbedder, check_document_id
from services.retriever.filters import digest
from services.retriever.records import AnswerUsage
from services.retriever.schema import MAX_TEXT_BYTES
from services.retriever.store import MilvusStore

DEFAULT_THRESHOLD = 0.92
DEFAULT_TTL_SECONDS = 7200
MAX_TTL_SECONDS = 30 * 24 * 3600
# Nearest entries considered per lookup: later ones are only tried when nearer ones are stale.
_CANDIDATES = 8


@dataclass(frozen=True)
class CacheScope:
    """Who may see an entry: the same tenant, model and sampling parameters."""

    tenant: str
    model: str
    params_fingerprint: str

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgument("model", "must name the model the answer comes from")
        if len(self.model) > 256:
            raise InvalidArgument("model", "must be at most 256 characters")
        if len(self.params_fingerprint) > 256:
            raise InvalidArgument("params_fingerprint", "must be at most 256 characters")

    @property
    def key(self) -> str:
        return digest(self.tenant, self.model, self.params_fingerprint)


@dataclass(frozen=True)
class CacheHit:
    entry_id: str
    answer: str
    similarity: float
    cached_prompt: str
    age_seconds: float
    #: The original answer's usage as stored; all zero for an entry stored without it.
    usage: AnswerUsage = field(default_factory=AnswerUsage)


def check_prompt(prompt: str) -> None:
    if not prompt.strip():
        raise InvalidArgument("prompt", "must not be empty")
    if len(prompt.encode()) > MAX_TEXT_BYTES:
        raise InvalidArgument("prompt", f"must be at most {MAX_TEXT_BYTES} bytes")


class SemanticCache:
    """Cache look-ups and stores over the store's cache collection. Blocking: call from worker threads."""

    def __init__(
        self,
        store: MilvusStore,
        embedder: TextEmbedder,
        threshold: float = DEFAULT_THRESHOLD,
        ttl_seconds: int = DEFAULT_TTL_SECONDS,
        clock: Callable[[], float] = time.time,
        purge_interval_s: float = 60.0,
    ) -> None:
        if not -1.0 <= threshold <= 1.0:
            raise ValueError(f"--cache-threshold must be in [-1, 1], got {threshold}")
        if not 1 <= ttl_seconds <= MAX_TTL_SECONDS:
            raise ValueError(f"--cache-ttl-seconds must be in 1..{MAX_TTL_SECONDS}, got {ttl_seconds}")
        self._store = store
        self._embedder = embedder
        self.threshold = threshold
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._purge_interval_s = purge_interval_s
        self._last_purge = -math.inf
        self._purge_lock = threading.Lock()

    def lookup(self, scope: CacheScope, prompt: str, threshold: float | None = None) -> CacheHit | None:
        check_prompt(prompt)
        if threshold is not None and not (math.isfinite(threshold) and -1.0 <= threshold <= 1.0):
            raise InvalidArgument("threshold", f"must be a cosine similarity in [-1, 1], got {threshold}")
        minimum = self.threshold if threshold is None else threshold
        now = self._clock()
        self._maybe_purge(now)
        vector = self._embedder.embed([prompt])[0]
        candidates = [
            row
            for row in self._store.search_cache(scope.key, vector, int(now * 1000), _CANDIDATES)
            if row.similarity >= minimum
        ]
        if not candidates:
            return None
        cited = {document_id for row in candidates for document_id, _ in row.cited}
        keys = {document_id: digest(scope.tenant, document_id) for document_id in cited}
        current = self._store.current_versions(scope.tenant, keys.values())
        retired: list[str] = []
        hit: CacheHit | None = None
        for row in candidates:  # most similar first
            if any(current.get(keys[d]) != version for d, version in row.cited):
                retired.append(row.entry_id)  # a cited document changed or is gone
                continue
            hit = CacheHit(
                row.entry_id,
                row.answer,
                row.similarity,
                row.prompt,
                now - row.created_at_ms / 1000,
                row.usage,
            )
            break
        self._store.delete_cache_entries(retired)
        return hit

    def store(
        self,
        scope: CacheScope,
        prompt: str,
        answer: str,
        ttl_seconds: int = 0,
        cited: Sequence[tuple[str, int]] = (),
        usage: AnswerUsage = AnswerUsage(),
    ) -> str:
        check_prompt(prompt)
        if not answer:
            raise InvalidArgument("answer", "must not be empty")
        if len(answer.encode()) > MAX_TEXT_BYTES:
            raise InvalidArgument("answer", f"must be at most {MAX_TEXT_BYTES} bytes")
        if ttl_seconds > MAX_TTL_SECONDS:
            raise InvalidArgument("ttl_seconds", f"must be at most {MAX_TTL_SECONDS}")
        pinned = self._pin_versions(scope.tenant, cited)
        now = self._clock()
        vector = self._embedder.embed([prompt])[0]
        entry_id = uuid.uuid4().hex
        self._store.put_cache_entry(
            entry_id,
            scope.tenant,
            scope.key,
            prompt,
            answer,
            vector,
            created_at_ms=int(now * 1000),
            expires_at_ms=int((now + (ttl_seconds or self.ttl_seconds)) * 1000),
            cited=pinned,
            usage=usage,
        )
        return entry_id

    def _pin_versions(self, tenant: str, cited: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """Cited versions, with 0 ("whatever is current") replaced by the current version."""
        for document_id, _ in cited:
            check_document_id(document_id, "cited.document_id")
        keys = {document_id: digest(tenant, document_id) for document_id, _ in cited}
        current = self._store.current_versions(tenant, keys.values())
        pinned = []
        for document_id, version in cited:
            now_version = current.get(keys[document_id])
            if now_version is None:
                raise NotFound(f"cited document {document_id!r} not found")
            # Refused, not clamped: a version not yet written names no content the answer could
            # have come from, and the entry would come back to life once re-ingests reach it.
            if version > now_version:
                raise InvalidArgument(
                    "cited.version",
                    f"document {document_id!r} is at version {now_version}; {version} was never "
                    "written (0 = its current version)",
                )
            pinned.append((document_id, version or now_version))
        return pinned

    def _maybe_purge(self, now: float) -> None:
        with self._purge_lock:
            if now - self._last_purge < self._purge_interval_s:
                return
            self._last_purge = now
        self._store.purge_expired_cache(int(now * 1000))
