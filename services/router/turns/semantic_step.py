"""A turn's semantic-cache layer: scope the lookup, verify the candidate, ask its confidence, learn.

The retriever finds the nearest cached question within the whole question's scope
(``semantic_scope``); the router serves its answer only if the verifier finds that
it asks the same thing (``semantic_verify``) and the entry's confidence allows it
(``semantic_confidence``). An entry its confidence refuses, or one picked for a
refresh, is answered fresh and compared with the fresh answer: that is how it learns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from services.gen.llmmesh.v1 import router_pb2
from services.router import metrics
from services.router.turns.dependencies import TurnServices
from services.router.turns.response_cache import CachedAnswer, sampling_fingerprint
from services.router.turns.semantic_confidence import Decision, answers_agree
from services.router.turns.semantic_scope import is_personal, last_user_index, scope_fingerprint
from services.router.turns.semantic_verify import MAX_VERIFIED_CHARS, refusal
from services.router.turns.turn_end import TurnState

# Questions this short (both together) are verified inline: well under a millisecond.
INLINE_VERIFY_CHARS = 400


@dataclass(frozen=True)
class SemanticPlan:
    """What the turn's semantic lookup and fill use: the compared message and the question's scope."""

    prompt: str
    fingerprint: str
    cited: tuple[tuple[str, int], ...] = ()


def semantic_plan(
    s: TurnServices,
    request: router_pb2.ChatRequest,
    messages: Sequence[tuple[str, str]],
    cited: Sequence[tuple[str, int]],
) -> SemanticPlan | None:
    """None where the turn does not use the semantic cache (off, or a personal question with no user)."""
    if not request.cache.semantic or s.semantic_cache is None or not messages:
        return None
    if request.prompt or request.prompt_token_ids:
        # The scope knows conversations: a raw prompt's text could meet a chat question's entry.
        metrics.SEMANTIC_SKIPPED.labels(reason="raw_prompt").inc()
        return None
    prompt = messages[last_user_index(messages)][1]
    if not prompt.strip():
        # Nothing to compare: the retriever refuses an empty text, which failed the whole turn.
        metrics.SEMANTIC_SKIPPED.labels(reason="blank").inc()
        return None
    if len(prompt) > MAX_VERIFIED_CHARS:
        metrics.SEMANTIC_SKIPPED.labels(reason="too_long").inc()
        return None
    policy = request.cache
    personal = policy.personal if policy.HasField("personal") else is_personal(prompt)
    if personal and not policy.user:
        metrics.SEMANTIC_SKIPPED.labels(reason="personal_without_user").inc()
        return None  # another user's "my order" would look exactly the same
    fingerprint = scope_fingerprint(
        sampling_fingerprint(request.sampling),
        messages,
        cited,
        policy.user if personal else None,
        request.cache_salt,
    )
    return SemanticPlan(prompt, fingerprint, tuple(cited))


async def serve_or_learn(
    s: TurnServices, tenant: str, plan: SemanticPlan, hit: CachedAnswer, state: TurnState
) -> bool:
    """Whether to serve a semantic candidate; a refused or refreshed one is remembered to learn from."""
    if len(plan.prompt) + len(hit.cached_prompt) <= INLINE_VERIFY_CHARS:
        reason = refusal(plan.prompt, hit.cached_prompt)
    else:  # a few ms of pure Python: off the event loop, which other turns share
        reason = await asyncio.to_thread(refusal, plan.prompt, hit.cached_prompt)
    if reason is not None:
        metrics.SEMANTIC_REJECTIONS.labels(reason=reason).inc()
        return False
    if s.semantic_confidence is None or not hit.entry_id:
        return True
    decision = await s.semantic_confidence.decide(tenant, hit.entry_id, hit.similarity)
    if decision is Decision.SERVE:
        return True
    if decision is Decision.REFUSE:
        metrics.SEMANTIC_REJECTIONS.labels(reason="confidence").inc()
    state.semantic_candidate = (hit.entry_id, hit.text, hit.similarity)
    return False


async def learn(s: TurnServices, tenant: str, state: TurnState, fresh: str) -> bool:
    """A fresh answer to a question a cached entry was a candidate for teaches that entry.

    True when it agreed with that entry's answer: the cache holds it already.
    """
    if state.semantic_candidate is None or s.semantic_confidence is None:
        return False
    entry_id, cached, similarity = state.semantic_candidate
    agreed = answers_agree(cached, fresh)
    await s.semantic_confidence.record(tenant, entry_id, similarity, agreed)
    metrics.SEMANTIC_REFRESHES.labels(outcome="agreed" if agreed else "differed").inc()
    return agreed
