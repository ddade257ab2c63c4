"""llm-mesh's own features over HTTP: body fields beside OpenAI's, the request-id header, and the
``llm_mesh`` field answers carry back.

The fields are what the gRPC ``ChatRequest`` already has (``session_id``, ``rag``, ``cache``), so an
HTTP turn gets exactly what a gRPC one does. Being our own names, they are checked strictly: a typo
inside ``rag`` is a 400, not an ignored key (unknown top-level fields are OpenAI's to add, so those
are only logged).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.gen.llmmesh.v1 import router_pb2
from services.router.api.openai.body import finite_number
from services.router.api.openai.errors import bad_request
from services.router.placement.cache_scope import MAX_CLIENT_SALT_BYTES

#: Body fields this module reads: ``params`` treats them as known.
FIELDS = frozenset(
    {"session_id", "session_required", "session_must_exist", "rag", "cache", "resumable", "cache_salt"}
)
MAX_RAG_TOP_K = 20
# A request id becomes part of Redis keys (``llm:replay:{id}``, a Cluster hash tag) and SSE ``id:``
# lines: no braces, no whitespace, no newlines. 120 leaves room for the ``-<choice>`` suffix
# within the turn's 128-character limit.
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,120}")
_CACHE_MODES = {
    "default": router_pb2.CACHE_MODE_DEFAULT,
    "bypass": router_pb2.CACHE_MODE_BYPASS,
    "refresh": router_pb2.CACHE_MODE_REFRESH,
}
_RAG_KEYS = frozenset({"top_k", "filter", "min_score", "required", "mode", "rerank"})
# rag.mode's words, as retriever.proto's SearchMode numbers.
_RAG_MODES = {"dense": 1, "keyword": 2, "hybrid": 3}
_CACHE_KEYS = frozenset({"mode", "semantic", "semantic_threshold", "personal"})
# OpenAI's `user`: who a personal question's cached answer belongs to (CachePolicy.user).
MAX_USER_CHARS = 256
_LAYERS = {router_pb2.CACHE_LAYER_EXACT: "exact", router_pb2.CACHE_LAYER_SEMANTIC: "semantic"}


@dataclass(frozen=True)
class Extras:
    """What the llm-mesh fields of one body ask for, applied to each of its turns."""

    session_id: str = ""
    session_required: bool = False
    #: 404 for a session id this tenant does not have, instead of starting a new conversation.
    session_must_exist: bool = False
    rag: router_pb2.RagOptions | None = None
    cache: router_pb2.CachePolicy | None = None
    #: Keep generating when the client disconnects, so it can come back with ``Last-Event-ID``.
    resumable: bool = False
    #: vLLM's ``cache_salt``: the turn's prompt blocks are reused only among turns with this salt
    #: (within the tenant's own scope; ``placement/cache_scope.py``). Not in ``any``: it changes
    #: nothing the answer reports.
    cache_salt: str = ""

    @property
    def any(self) -> bool:
        """Whether the request used any of them: only then does the answer carry ``llm_mesh``."""
        return bool(self.session_id or self.rag is not None or self.cache is not None or self.resumable)

    def apply(self, turn: router_pb2.ChatRequest) -> None:
        turn.session_id = self.session_id
        turn.session_required = self.session_required
        turn.session_must_exist = self.session_must_exist
        if self.rag is not None:
            turn.rag.CopyFrom(self.rag)
        if self.cache is not None:
            turn.cache.CopyFrom(self.cache)
        turn.cache_salt = self.cache_salt


def extras(body: Mapping[str, Any], choices: int) -> Extras:
    """The llm-mesh fields of ``body`` (already known to be an object); ``choices`` = prompts × n."""
    session_id = body.get("session_id")
    if session_id is not None and (
        not isinstance(session_id, str) or not REQUEST_ID_RE.fullmatch(session_id)
    ):
        raise bad_request("session_id", "session_id: 1-120 characters of letters, digits and . _ : -")
    if session_id and choices > 1:
        # Every choice would append its own answer to the one conversation.
        raise bad_request("n", "n: a request with session_id has one choice (and one prompt)")
    session_required = _flag(body, "session_required")
    session_must_exist = _flag(body, "session_must_exist")
    if session_must_exist and not session_id:
        raise bad_request("session_must_exist", "session_must_exist: needs a session_id")
    resumable = _flag(body, "resumable")
    if resumable and not _flag(body, "stream"):
        raise bad_request("resumable", "resumable: only a stream (stream: true) can be resumed")
    return Extras(
        session_id or "",
        session_required,
        session_must_exist,
        _rag(body.get("rag")),
        _cache(body.get("cache"), body.get("user")),
        resumable,
        _cache_salt(body.get("cache_salt")),
    )


def request_id_header(value: str | None) -> str | None:
    """``x-request-id``, checked: it names the turn in the replay buffer, the logs and the SSE ids."""
    if value is None:
        return None
    if not REQUEST_ID_RE.fullmatch(value):
        raise bad_request(
            "x-request-id", "header x-request-id: 1-120 characters of letters, digits and . _ : -"
        )
    return value


def response_extras(end: router_pb2.TurnEnd) -> dict[str, Any]:
    """The ``llm_mesh`` field of an answer (or of a stream's finishing chunk): what the TurnEnd says."""
    return {
        "citations": [
            {
                "document_id": c.document_id,
                "title": c.title,
                "chunk_id": c.chunk_id,
                "position": c.position,
                "score": round(float(c.score), 6),
                "snippet": c.snippet,
            }
            for c in end.citations
        ],
        "session_id": end.session_id or None,
        "session_version": end.session_version or None,
        "cache_layer": _LAYERS.get(end.cache_layer),
        "degraded": end.degraded,
        "degraded_reasons": list(end.degraded_reasons),
        "replica": end.replica or None,
    }


def _cache_salt(raw: Any) -> str:
    """vLLM's ``cache_salt``: absent or null = none; otherwise a non-empty string, as vLLM checks it."""
    if raw is None:
        return ""
    if not isinstance(raw, str) or not raw:
        raise bad_request("cache_salt", "cache_salt: a non-empty string if given")
    try:
        size = len(raw.encode("utf-8"))
    except UnicodeEncodeError:
        raise bad_request("cache_salt", "cache_salt: must be valid Unicode text") from None
    if size > MAX_CLIENT_SALT_BYTES:
        raise bad_request("cache_salt", f"cache_salt: at most {MAX_CLIENT_SALT_BYTES} bytes")
    return raw


def _rag(raw: Any) -> router_pb2.RagOptions | None:
    if raw is None or raw is False:
        return None
    if raw is True:
        return router_pb2.RagOptions(enabled=True)
    if not isinstance(raw, dict):
        raise bad_request("rag", "rag: true, or an object {top_k, filter, min_score, required, mode, rerank}")
    for key in raw:
        if key not in _RAG_KEYS:
            raise bad_request(
                f"rag.{key}",
                f"rag.{key}: unknown; rag takes top_k, filter, min_score, required, mode, rerank",
            )
    rag = router_pb2.RagOptions(enabled=True)
    top_k = raw.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_RAG_TOP_K:
            raise bad_request("rag.top_k", f"rag.top_k: an integer in 1..{MAX_RAG_TOP_K}")
        rag.top_k = top_k
    where = raw.get("filter")
    if where is not None:
        if not isinstance(where, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in where.items()
        ):
            raise bad_request("rag.filter", "rag.filter: an object of string keys to string values")
        rag.filter.update(where)
    min_score = raw.get("min_score")
    if min_score is not None:
        if (score := finite_number(min_score)) is None:
            raise bad_request("rag.min_score", "rag.min_score: a number")
        rag.min_score = score
    rag.required = _flag(raw, "required", "rag.")
    mode = raw.get("mode")
    if mode is not None:
        if mode not in _RAG_MODES:
            raise bad_request("rag.mode", f"rag.mode: one of {', '.join(_RAG_MODES)}")
        rag.mode = _RAG_MODES[mode]  # type: ignore[assignment]
    if raw.get("rerank") is not None:
        rag.rerank = _flag(raw, "rerank", "rag.")
    return rag


def _cache(raw: Any, user: Any = None) -> router_pb2.CachePolicy | None:
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise bad_request("user", f"user: a string of at most {MAX_USER_CHARS} characters")
    if raw is None:
        return None
    if isinstance(raw, str):  # shorthand: "bypass"
        raw = {"mode": raw}
    if not isinstance(raw, dict):
        raise bad_request(
            "cache", "cache: a mode string or an object {mode, semantic, semantic_threshold, personal}"
        )
    for key in raw:
        if key not in _CACHE_KEYS:
            raise bad_request(
                f"cache.{key}",
                f"cache.{key}: unknown; cache takes mode, semantic, semantic_threshold, personal",
            )
    policy = router_pb2.CachePolicy()
    mode = raw.get("mode")
    if mode is not None:
        if mode not in _CACHE_MODES:
            raise bad_request("cache.mode", "cache.mode: one of default, bypass, refresh")
        policy.mode = _CACHE_MODES[mode]
    policy.semantic = _flag(raw, "semantic", "cache.")
    threshold = raw.get("semantic_threshold")
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
            raise bad_request("cache.semantic_threshold", "cache.semantic_threshold: a number in (0, 1]")
        policy.semantic_threshold = float(threshold)
    if raw.get("personal") is not None:
        policy.personal = _flag(raw, "personal", "cache.")
    policy.user = user or ""
    return policy


def _flag(raw: Mapping[str, Any], name: str, prefix: str = "") -> bool:
    value = raw.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{prefix}{name}", f"{prefix}{name}: must be true or false")
    return value
