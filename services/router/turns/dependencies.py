"""What a turn may use: the pool, the relay, limits, caches and context, wired once by the runtime."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.gen.llmmesh.v1 import inference_pb2
from services.router.admission.ratelimit import InflightLimiter, RateLimiter
from services.router.placement import cache_scope
from services.router.placement.models import ModelCatalog
from services.router.placement.pins import AffinityPins
from services.router.placement.pool import ReplicaPool
from services.router.placement.request import NO_PREFIX, PromptPrefix
from services.router.streams.relay import Relay
from services.router.streams.replay import ReplayBuffer
from services.router.turns.context import ConversationContext
from services.router.turns.response_cache import ExactCache, SemanticCache
from services.router.turns.semantic_confidence import EntryConfidence
from services.router.turns.semantic_verify import DEFAULT_CANDIDATE_THRESHOLD

#: The prompt's chained block hashes for prefix-aware placement, from the generation about to
#: start and its first model. The router's tokenizer fills this in; until it is wired, none.
PromptHasher = Callable[[inference_pb2.GenerateStart, str], Awaitable[PromptPrefix]]


async def no_prefix(start: inference_pb2.GenerateStart, model: str) -> PromptPrefix:
    """No tokenizer in this router: placement goes without the prompt's prefix."""
    return NO_PREFIX


@dataclass
class TurnServices:
    """Everything a turn may use; the optional ones are off when not configured."""

    pool: ReplicaPool
    relay: Relay
    catalog: ModelCatalog
    pins: AffinityPins
    rate_limiter: RateLimiter | None = None
    inflight: InflightLimiter | None = None
    exact_cache: ExactCache | None = None
    semantic_cache: SemanticCache | None = None
    #: Per-entry confidence of semantic hits; None serves every verified hit.
    semantic_confidence: EntryConfidence | None = None
    #: The cosine a semantic candidate must reach before it is verified (unless the request sets one).
    semantic_threshold: float = DEFAULT_CANDIDATE_THRESHOLD
    context: ConversationContext | None = None
    replay: ReplayBuffer | None = None
    #: Told where each session's turn ran (replica, tenant, session id, the generation's cache
    #: salt), to move and pre-warm sessions off a lost replica.
    on_session_served: Callable[[str, str, str, str], None] | None = None
    clock: Callable[[], float] = time.monotonic
    #: Where the prompt's prefix blocks come from (the one place they enter placement).
    prompt_prefix: PromptHasher = no_prefix
    #: Whose cached prompt blocks a turn may reuse (``placement/cache_scope.py``).
    prefix_cache_scope: str = cache_scope.TENANT
