"""Response caches: exact (Redis, hash of model + messages + sampling) and semantic (through the retriever).

Only deterministic requests are cached exactly: greedy (temperature 0) or
seeded sampling, where the same input must give the same answer anyway.
Both caches sit behind a circuit breaker; an outage raises
``DependencyUnavailable`` and the caller answers uncached, flagged degraded.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from services.common import errors
from services.gen.llmmesh.v1 import common_pb2, retriever_pb2
from services.router.admission.auth import Principal, downstream_metadata
from services.router.admission.breaker import CircuitBreaker

if TYPE_CHECKING:
    from services.gen.llmmesh.v1.retriever_pb2_grpc import RetrieverAsyncStub

DEFAULT_SEMANTIC_THRESHOLD = 0.92
# Bumped when the key's recipe changes, so old entries are simply never hit again.
KEY_VERSION = "v1"


@dataclass
class CachedAnswer:
    """A whole answer as the cache keeps it, enough to replay it as a stream."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    model: str = ""
    finish_reason: int = common_pb2.FINISH_REASON_STOP
    # The original answer's usage (its TurnEnd's), which a hit replays: the whole answer's
    # tokens, every replica's part of a failed-over one included.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    created_at_ms: int = 0
    # For a semantic hit: how close the cached prompt was, and which it was.
    similarity: float = 0.0
    cached_prompt: str = ""
    #: The semantic entry's id, which its per-entry confidence is kept under.
    entry_id: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> CachedAnswer:
        data = json.loads(raw)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def is_deterministic(sampling: common_pb2.SamplingParams) -> bool:
    """Greedy or seeded: the same request gives the same answer, so caching it changes nothing."""
    greedy = sampling.HasField("temperature") and sampling.temperature == 0
    return greedy or sampling.HasField("seed")


def sampling_fingerprint(sampling: common_pb2.SamplingParams) -> str:
    """A stable hash of every sampling field that can change the answer."""
    fields: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty"):
        if sampling.HasField(name):
            value = getattr(sampling, name)
            # Float32 round-trip noise must not split the cache: 0.7 and 0.69999999 are one setting.
            fields[name] = round(value, 6) if isinstance(value, float) else value
    # Added after the cache's first keys: present only when they move the logits, so the keys of
    # requests without them are what they were.
    for name in ("presence_penalty", "frequency_penalty", "min_p"):
        if getattr(sampling, name):
            fields[name] = round(getattr(sampling, name), 6)
    for name in ("stop_token_ids", "allowed_token_ids", "bad_words"):
        if getattr(sampling, name):
            fields[name] = list(getattr(sampling, name))
    if sampling.include_stop_str_in_output:
        fields["include_stop_str_in_output"] = True
    if sampling.min_tokens:
        fields["min_tokens"] = sampling.min_tokens
    if sampling.max_tokens_to_context and not sampling.HasField("max_tokens"):
        fields["max_tokens_to_context"] = True  # a whole answer is not one cut at 256 tokens
    if sampling.logit_bias:
        fields["logit_bias"] = sorted((token, round(bias, 6)) for token, bias in sampling.logit_bias.items())
    fields["stop"] = list(sampling.stop)
    fields["ignore_eos"] = sampling.ignore_eos
    # An output constraint changes the answer: a constrained request never gets a free one.
    constraint = sampling.WhichOneof("constraint")
    if constraint is not None:
        value = getattr(sampling, constraint)
        fields[constraint] = list(value.values) if constraint == "choice" else value
    # Greedy decoding ignores the seed and the nucleus settings.
    if sampling.HasField("temperature") and sampling.temperature == 0:
        for name in ("seed", "top_p", "top_k", "min_p"):
            fields.pop(name, None)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def exact_cache_key(
    model: str, messages: Sequence[tuple[str, str]], sampling: common_pb2.SamplingParams, cache_salt: str = ""
) -> str | None:
    """The exact-cache key of a request, or None when its answer is not deterministic.

    A ``cache_salt`` (the client's isolation of its KV prefix cache) scopes the answer too: a
    cached answer is as telling as a cached prefix. No salt keeps the key it always had.
    """
    if not is_deterministic(sampling):
        return None
    if sampling.logprobs or sampling.top_logprobs or sampling.HasField("prompt_logprobs"):
        return None  # a cached answer has no logprobs to give back
    for name in (
        "temperature",
        "top_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "min_p",
    ):
        if sampling.HasField(name) and not math.isfinite(getattr(sampling, name)):
            return None
    if not all(math.isfinite(bias) for bias in sampling.logit_bias.values()):
        return None
    doc = {"v": KEY_VERSION, "model": model, "messages": [list(m) for m in messages]}
    doc["sampling"] = sampling_fingerprint(sampling)
    if cache_salt:
        doc["salt"] = cache_salt
    return hashlib.sha256(json.dumps(doc, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class ExactCache:
    """Answers in Redis under ``llm:cache:exact:{tenant}:{key}``, with a TTL; tenants never share entries."""

    def __init__(self, redis: Any, ttl_s: int = 3600, breaker: CircuitBreaker | None = None) -> None:
        if ttl_s < 1:
            raise ValueError(f"ttl_s: must be >= 1, got {ttl_s}")
        self.redis = redis
        self.ttl_s = ttl_s
        self.breaker = breaker or CircuitBreaker("exact-cache")

    @staticmethod
    def redis_key(tenant: str, key: str) -> str:
        return f"llm:cache:exact:{tenant}:{key}"

    async def get(self, tenant: str, key: str) -> CachedAnswer | None:
        raw = await self.breaker.call(lambda: self.redis.get(self.redis_key(tenant, key)))
        return None if raw is None else CachedAnswer.from_json(raw)

    async def put(self, tenant: str, key: str, answer: CachedAnswer) -> None:
        if answer.finish_reason not in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH):
            return  # a cancelled or failed answer is not the answer
        await self.breaker.call(
            lambda: self.redis.set(self.redis_key(tenant, key), answer.to_json(), ex=self.ttl_s)
        )


class SemanticCache:
    """Similar-prompt answers through the retriever's CacheLookup/CacheStore, per tenant."""

    def __init__(
        self,
        retriever: RetrieverAsyncStub,
        breaker: CircuitBreaker | None = None,
        timeout_s: float = 2.0,
        ttl_s: int = 0,
    ) -> None:
        self.retriever = retriever
        self.breaker = breaker or CircuitBreaker("semantic-cache")
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s

    async def lookup(
        self,
        tenant: str,
        prompt: str,
        model: str,
        params_fingerprint: str,
        threshold: float | None = None,
    ) -> CachedAnswer | None:
        if threshold is not None and not -1.0 <= threshold <= 1.0:
            raise errors.InvalidArgument("cache.semantic_threshold", f"must be in [-1, 1], got {threshold}")
        request = retriever_pb2.CacheLookupRequest(
            prompt=prompt, model=model, params_fingerprint=params_fingerprint, threshold=threshold
        )
        response = await self.breaker.call(
            lambda: self.retriever.CacheLookup(request, metadata=_tenant_md(tenant), timeout=self.timeout_s)
        )
        if not response.hit:
            return None
        return CachedAnswer(
            text=response.answer,
            model=model,
            # An entry stored without a finish reason (an older router) ended as most do.
            finish_reason=response.finish_reason or common_pb2.FINISH_REASON_STOP,
            # All zero for an entry stored without usage: unknown, not guessed.
            prompt_tokens=response.usage.prompt_tokens,
            completion_tokens=response.usage.completion_tokens,
            cached_prompt_tokens=response.usage.cached_prompt_tokens,
            similarity=response.similarity,
            cached_prompt=response.cached_prompt,
            entry_id=response.entry_id,
        )

    async def store(
        self,
        tenant: str,
        prompt: str,
        model: str,
        params_fingerprint: str,
        answer: CachedAnswer,
        cited: Sequence[tuple[str, int]] = (),
    ) -> str | None:
        """Store an answer; ``cited`` (document id, version) pairs let a document update invalidate it."""
        if answer.finish_reason not in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH):
            return None
        request = retriever_pb2.CacheStoreRequest(
            prompt=prompt,
            model=model,
            params_fingerprint=params_fingerprint,
            answer=answer.text,
            ttl_seconds=self.ttl_s,
            cited=[retriever_pb2.CitedDocument(document_id=d, version=v) for d, v in cited],
            # The original answer's usage and ending, which every hit on this entry replays.
            usage=common_pb2.Usage(
                prompt_tokens=answer.prompt_tokens,
                completion_tokens=answer.completion_tokens,
                cached_prompt_tokens=answer.cached_prompt_tokens,
            ),
            finish_reason=answer.finish_reason,  # type: ignore[arg-type]
        )
        try:
            response = await self.breaker.call(
                lambda: self.retriever.CacheStore(
                    request, metadata=_tenant_md(tenant), timeout=self.timeout_s
                )
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None  # a cited document was deleted meanwhile: the answer rests on nothing now
            raise
        return str(response.entry_id)


def _tenant_md(tenant: str) -> tuple[tuple[str, str], ...]:
    return downstream_metadata(Principal(tenant, "router"))[:1]
