"""What a turn's request must be before any work is done: roles, ids, RAG bounds; and its request id."""

from __future__ import annotations

import uuid

from services.common import errors
from services.common.ids import check_client_id, check_session_id
from services.common.sampling_limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from services.gen.llmmesh.v1 import router_pb2
from services.router.placement.cache_scope import MAX_CLIENT_SALT_BYTES

ROLES = frozenset({"system", "user", "assistant", "tool"})
# The end user a personal semantic-cache entry belongs to: an id, not a document.
MAX_CACHE_USER_CHARS = 256


def validate(request: router_pb2.ChatRequest, field_prefix: str = "") -> None:
    """Reject bad input with a message naming the field (after ``field_prefix``), before any work is done."""
    if request.prompt and request.prompt_token_ids:
        raise errors.InvalidArgument(
            f"{field_prefix}prompt_token_ids", "send a prompt as text or as token ids, not both"
        )
    if request.prompt or request.prompt_token_ids:
        # A raw prompt is a text to continue, not a conversation: nothing to add history or sources to.
        if request.messages:
            field = "prompt" if request.prompt else "prompt_token_ids"
            raise errors.InvalidArgument(f"{field_prefix}{field}", "send messages or a prompt, not both")
        if request.session_id:
            raise errors.InvalidArgument(
                f"{field_prefix}session_id", "a raw prompt has no session (use messages)"
            )
        if request.rag.enabled:
            raise errors.InvalidArgument(
                f"{field_prefix}rag", "a raw prompt takes no RAG context (use messages)"
            )
    elif not request.messages:
        raise errors.InvalidArgument(
            f"{field_prefix}messages", "at least one message (or a prompt) is required"
        )
    for i, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise errors.InvalidArgument(
                f"{field_prefix}messages[{i}].role",
                f"must be one of system, user, assistant, tool; got {message.role[:32]!r}",
            )
    if request.session_id:  # empty: no conversation kept
        check_session_id(request.session_id, f"{field_prefix}session_id")
    if request.request_id:  # empty: the router mints one
        check_client_id(request.request_id, f"{field_prefix}request_id")
    if request.cache.mode not in router_pb2.CacheMode.values():
        known = ", ".join(f"{v} ({n})" for n, v in router_pb2.CacheMode.items())
        raise errors.InvalidArgument(
            f"{field_prefix}cache.mode", f"unknown cache mode {request.cache.mode}; known: {known}"
        )
    if request.cache.HasField("semantic_threshold") and not 0.0 < request.cache.semantic_threshold <= 1.0:
        # NaN fails this too; the lookup would otherwise refuse it only after the turn began.
        raise errors.InvalidArgument(
            f"{field_prefix}cache.semantic_threshold",
            f"must be a cosine in (0, 1], got {request.cache.semantic_threshold}",
        )
    if len(request.cache.user) > MAX_CACHE_USER_CHARS:
        raise errors.InvalidArgument(
            f"{field_prefix}cache.user", f"must be at most {MAX_CACHE_USER_CHARS} characters"
        )
    # The replica checks every sampling setting; the sizes are checked here too because the
    # router hashes the lists into cache keys before a replica sees them (a 4 MB logit_bias took
    # 0.55 s of the event loop to hash).
    sampling = request.sampling
    for name, size, limit in (
        ("logit_bias", len(sampling.logit_bias), MAX_LOGIT_BIAS),
        ("stop_token_ids", len(sampling.stop_token_ids), MAX_STOP_TOKEN_IDS),
        ("allowed_token_ids", len(sampling.allowed_token_ids), MAX_ALLOWED_TOKEN_IDS),
        ("bad_words", len(sampling.bad_words), MAX_BAD_WORDS),
        ("stop", len(sampling.stop), MAX_STOP_STRINGS),
    ):
        if size > limit:
            raise errors.InvalidArgument(
                f"{field_prefix}sampling.{name}", f"at most {limit} entries, got {size}"
            )
    if len(request.cache_salt.encode("utf-8")) > MAX_CLIENT_SALT_BYTES:
        raise errors.InvalidArgument(
            f"{field_prefix}cache_salt", f"must be at most {MAX_CLIENT_SALT_BYTES} bytes"
        )
    if request.rag.enabled and request.rag.top_k > 20:
        raise errors.InvalidArgument(f"{field_prefix}rag.top_k", f"must be in 0..20, got {request.rag.top_k}")


def turn_request_id(request: router_pb2.ChatRequest) -> str:
    """The turn's request id: the client's, else one minted here.

    The only place a turn's id is made (the front doors that name their own, the OpenAI
    completion id and a task's, set it before): it numbers the turn's messages and keys its
    Resume buffer (with the tenant), and begins the engine id the replica knows the
    generation by (``TurnState.engine_id``), so it follows the turn through every log.
    """
    return request.request_id or uuid.uuid4().hex
