"""A turn's response caches: whether it may read and fill them, the lookup, the fill, the stale fallback.

A cache that fails degrades the turn (the reason goes in the TurnEnd), never fails it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from services.common import errors, tracing
from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.streams.relay import RelayOutcome
from services.router.turns.dependencies import TurnServices
from services.router.turns.response_cache import CachedAnswer, exact_cache_key
from services.router.turns.semantic_step import SemanticPlan, learn, semantic_plan, serve_or_learn
from services.router.turns.turn_end import TurnState

log = logging.getLogger("llmmesh.router.cache")

DEGRADED_ANSWER = "The service is busy and cannot answer right now; please try again shortly."


@dataclass(frozen=True)
class CachePlan:
    """The turn's cache key (None: not cacheable, or no cache) and what the client lets it do."""

    key: str | None
    may_read: bool
    may_fill: bool
    #: The semantic layer's scope; None where the turn does not use it.
    semantic: SemanticPlan | None = None
    #: The model the key is for: an answer a fallback model gave is not stored under it.
    model: str = ""


def cache_plan(
    s: TurnServices,
    request: router_pb2.ChatRequest,
    model: str,
    messages: list[tuple[str, str]],
    resumed: bool,
    cited: Sequence[tuple[str, int]] = (),
) -> CachePlan:
    """A resumed turn never reads: its answer has begun, and a hit would be another answer."""
    cache_mode = request.cache.mode
    caching = s.exact_cache is not None or (request.cache.semantic and s.semantic_cache is not None)
    key = exact_cache_key(model, messages, request.sampling, request.cache_salt) if caching else None
    may_read = not resumed and cache_mode in (
        router_pb2.CACHE_MODE_UNSPECIFIED,
        router_pb2.CACHE_MODE_DEFAULT,
    )
    # Only deterministic answers (those with an exact key) are cached semantically either.
    semantic = semantic_plan(s, request, messages, cited) if key is not None else None
    return CachePlan(key, may_read, cache_mode != router_pb2.CACHE_MODE_BYPASS, semantic, model)


async def cache_lookup(
    s: TurnServices,
    tenant: str,
    plan: CachePlan,
    request: router_pb2.ChatRequest,
    model: str,
    state: TurnState,
) -> tuple[CachedAnswer, int] | None:
    """The exact cache, then the semantic one (verified): the first hit and its layer, or None."""
    key = plan.key
    if key is not None and s.exact_cache is not None:
        try:
            with tracing.stage("exact cache lookup"):
                hit = await s.exact_cache.get(tenant, key)
        except Exception as exc:  # a cache that fails degrades the turn, never fails it
            state.degraded.append(f"exact cache: {_why(exc, 'lookup')}")
        else:
            if hit is not None:
                return hit, router_pb2.CACHE_LAYER_EXACT
    semantic = plan.semantic
    if semantic is not None and s.semantic_cache is not None:
        policy = request.cache
        threshold = (
            policy.semantic_threshold if policy.HasField("semantic_threshold") else s.semantic_threshold
        )
        try:
            # Its span is the retriever client's own ("semantic cache lookup", tracing.py).
            hit = await s.semantic_cache.lookup(
                tenant, semantic.prompt, model, semantic.fingerprint, threshold
            )
        except Exception as exc:  # any refusal too (INTERNAL reached the client before)
            state.degraded.append(f"semantic cache: {_why(exc, 'lookup')}")
        else:
            if hit is not None and await serve_or_learn(s, tenant, semantic, hit, state):
                return hit, router_pb2.CACHE_LAYER_SEMANTIC
    return None


async def cache_fill(
    s: TurnServices,
    tenant: str,
    plan: CachePlan,
    outcome: RelayOutcome,
    usage: common_pb2.Usage,
    answer: str,
    state: TurnState,
) -> None:
    """A finished answer stored in the exact cache and, where asked, the semantic one."""
    key = plan.key
    if key is None or outcome.finished is None:
        return
    # The turn's usage, as its TurnEnd says: a hit replays it (not the last replica's part).
    cached = CachedAnswer(
        text=answer,
        token_ids=list(outcome.token_ids),
        model=outcome.model,
        finish_reason=outcome.finished.finish_reason,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        created_at_ms=int(time.time() * 1000),
    )
    # The key names the model the turn asked for; when a fallback model answered (the first
    # was down), its answer would be served for the first model's until the entry expired.
    if s.exact_cache is not None and (not plan.model or outcome.model == plan.model):
        try:
            await s.exact_cache.put(tenant, key, cached)
        except Exception as exc:  # a cache failure degrades the turn, never fails it
            state.degraded.append(f"exact cache: {_why(exc)}")
    semantic = plan.semantic
    # A refresh that agreed stores nothing new: the entry it checked holds this answer already.
    # An empty answer (an end of sequence at once) is nothing to serve another question: the
    # retriever refuses it, which marked a normal turn degraded.
    if (
        semantic is not None
        and s.semantic_cache is not None
        and answer
        and not await learn(s, tenant, state, answer)
    ):
        try:
            await s.semantic_cache.store(
                tenant, semantic.prompt, outcome.model, semantic.fingerprint, cached, semantic.cited
            )
        except Exception as exc:  # an answer it refuses (past its size) too: the client has it
            state.degraded.append(f"semantic cache: {_why(exc)}")


def _why(exc: Exception, step: str = "store") -> str:
    """A cache ``step``'s (store, lookup) failure as a degradation note: an outage's own message,
    else its status."""
    if isinstance(exc, errors.DependencyUnavailable):
        return str(exc)
    missed = "not stored" if step == "store" else "not looked up"
    if isinstance(exc, grpc.aio.AioRpcError):
        log.warning("cache %s refused: %s: %s", step, exc.code().name, exc.details())
        return f"{missed} ({exc.code().name}: {exc.details()})"
    log.warning("cache %s failed", step, exc_info=exc)
    return f"{missed} ({type(exc).__name__})"


async def fallback_answer(s: TurnServices, tenant: str, key: str | None) -> tuple[CachedAnswer, int]:
    """What a turn no replica can serve answers: a stale cached answer if any, else a fixed reply."""
    stale: CachedAnswer | None = None
    if key is not None and s.exact_cache is not None:
        with contextlib.suppress(errors.DependencyUnavailable):
            stale = await s.exact_cache.get(tenant, key)
    layer = router_pb2.CACHE_LAYER_EXACT if stale is not None else router_pb2.CACHE_LAYER_UNSPECIFIED
    answer = stale or CachedAnswer(text=DEGRADED_ANSWER, finish_reason=common_pb2.FINISH_REASON_STOP)
    return answer, layer
