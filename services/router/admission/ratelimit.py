"""Admission: token-bucket rate limits per API key (shared by all routers via Redis) and an in-flight cap.

Each key has two buckets: requests (refills at ``requests_per_second`` up to
``burst``) and tokens (refills at ``tokens_per_minute / 60`` up to
``tokens_per_minute``). A request takes one request token and is refused while
the token bucket is in debt; generated tokens are charged afterwards and may
drive the bucket into debt (a long answer is not cut off), which then refuses
the key's next requests until it refills. The debt has no floor: one that stopped
at a minute's worth forgave the rest, so a key whose answers were each far past
its budget got many times its tokens per minute (111,000 against 1,000, measured). Both buckets live in one Redis hash
slot and are updated by one Lua script, so concurrent routers never double-spend.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.exceptions
from prometheus_client import Counter

from services.common import errors
from services.router.admission.auth import KeyLimits, Principal

log = logging.getLogger("llmmesh.router.ratelimit")

RATE_LIMITED = Counter(
    "llmmesh_router_rate_limited_total",
    "Requests refused by admission control, by reason (requests, tokens, in_flight).",
    ["reason"],
)

# KEYS[1] request bucket, KEYS[2] token bucket (hashes with fields tokens, ts_ms).
# ARGV: now_ms ('' = Redis TIME), request rate/s, request capacity, request cost,
#       token rate/s, token capacity, token cost. A rate <= 0 means no such limit.
# Returns {allowed (0/1), wait_ms, reason (1 requests, 2 tokens)}.
TOKEN_BUCKET_LUA = """
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function level(key, rate, cap)
  local b = redis.call('HMGET', key, 'tokens', 'ts_ms')
  local tokens, ts = tonumber(b[1]), tonumber(b[2])
  if tokens == nil then return cap end
  return math.min(cap, tokens + math.max(0, now - ts) * rate / 1000)
end
local function store(key, tokens, rate, cap)
  redis.call('HSET', key, 'tokens', tostring(tokens), 'ts_ms', tostring(now))
  -- Kept until it would be full again (plus any debt), then it is equal to absent.
  redis.call('PEXPIRE', key, math.ceil((cap - tokens) * 1000 / rate) + 1000)
end
local rr, rc, rcost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tr, tc, tcost = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local rlevel, tlevel
if rr > 0 then
  rlevel = level(KEYS[1], rr, rc)
  if rlevel < rcost then return {0, math.ceil((rcost - rlevel) * 1000 / rr), 1} end
end
if tr > 0 then
  tlevel = level(KEYS[2], tr, tc)
  -- Only an admission (a request taken) is refused by the debt; a charge of tokens already
  -- generated always lands, or every answer that ended while the key was in debt was free.
  if rcost > 0 and tlevel <= 0 then return {0, math.ceil((1 - tlevel) * 1000 / tr), 2} end
end
if rr > 0 and rcost > 0 then store(KEYS[1], rlevel - rcost, rr, rc) end
if tr > 0 and tcost > 0 then store(KEYS[2], tlevel - tcost, tr, tc) end
return {1, 0, 0}
"""


#: A key with no limits of its own (compared against on every request: made once).
NO_LIMITS = KeyLimits()


@dataclass(frozen=True)
class BucketSpec:
    """One bucket's refill rate (per second) and capacity; rate 0 = unlimited."""

    rate_per_s: float
    capacity: float

    @property
    def unlimited(self) -> bool:
        return self.rate_per_s <= 0


def request_bucket(limits: KeyLimits) -> BucketSpec:
    if limits.requests_per_second is None:
        return BucketSpec(0.0, 0.0)
    burst = limits.burst if limits.burst is not None else max(1, math.ceil(limits.requests_per_second))
    return BucketSpec(limits.requests_per_second, float(burst))


def token_bucket(limits: KeyLimits) -> BucketSpec:
    if limits.tokens_per_minute is None:
        return BucketSpec(0.0, 0.0)
    return BucketSpec(limits.tokens_per_minute / 60.0, limits.tokens_per_minute)


class LocalBuckets:
    """The same algorithm in process memory: used without Redis, or while Redis is down."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._levels: dict[str, tuple[float, float]] = {}  # key -> (tokens, at_s)

    def take(
        self, keys: tuple[str, str], req: BucketSpec, req_cost: float, tok: BucketSpec, tok_cost: float
    ) -> tuple[bool, float, int]:
        now = self._clock()
        levels: list[float] = []
        for key, spec in zip(keys, (req, tok), strict=True):
            tokens, at = self._levels.get(key, (spec.capacity, now))
            levels.append(
                min(spec.capacity, tokens + max(0.0, now - at) * spec.rate_per_s)
                if not spec.unlimited
                else 0.0
            )
        if not req.unlimited and levels[0] < req_cost:
            return False, (req_cost - levels[0]) / req.rate_per_s, 1
        if not tok.unlimited and req_cost > 0 and levels[1] <= 0:  # a charge always lands (as in Lua)
            return False, (1 - levels[1]) / tok.rate_per_s, 2
        if not req.unlimited and req_cost > 0:
            self._levels[keys[0]] = (levels[0] - req_cost, now)
        if not tok.unlimited and tok_cost > 0:
            self._levels[keys[1]] = (levels[1] - tok_cost, now)
        return True, 0.0, 0


class RateLimiter:
    """Per-key request and token buckets, in Redis when given one (atomic Lua), else local.

    ``default_limits`` apply to keys that set none of their own (including the
    anonymous caller of an open router).
    """

    def __init__(
        self,
        redis: Any = None,
        default_limits: KeyLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        use_redis_time: bool = True,
    ) -> None:
        self.redis = redis
        self.default_limits = default_limits or KeyLimits()
        self._local = LocalBuckets(clock)
        self._clock = clock
        # Tests pass use_redis_time=False with a fake clock, so Redis buckets refill on that clock.
        self._use_redis_time = use_redis_time
        self._script = redis.register_script(TOKEN_BUCKET_LUA) if redis is not None else None
        self._redis_down_logged = False

    def limits_for(self, principal: Principal, limits: KeyLimits | None = None) -> KeyLimits:
        if limits is not None and limits != NO_LIMITS:
            return limits
        if principal.limits != NO_LIMITS:
            return principal.limits
        return self.default_limits

    def counts_tokens(self, principal: Principal, limits: KeyLimits | None = None) -> bool:
        """Whether the key has a token budget (else ``record_tokens`` has nothing to do)."""
        return not token_bucket(self.limits_for(principal, limits)).unlimited

    async def admit_request(
        self, principal: Principal, limits: KeyLimits | None = None, requests: int = 1, field: str = "n"
    ) -> None:
        """Take ``requests`` requests at once, all or none; ``Overloaded`` (with retry-after) when the
        key is over its limits. More than the key's burst could never be taken: ``InvalidArgument``
        naming ``field`` (the caller's name for the count), not a 429 a client would retry forever
        while each try spent the requests it did get."""
        spec = self.limits_for(principal, limits)
        if spec.requests_per_second is None and spec.tokens_per_minute is None:
            return  # an unlimited key: nothing to take (the common case, on every request's path)
        bucket = request_bucket(spec)
        if not bucket.unlimited and requests > bucket.capacity:
            raise errors.InvalidArgument(
                field,
                f"{requests} requests at once are more than this key's burst of {bucket.capacity:g}: "
                "send fewer at a time",
            )
        await self._take(principal, bucket, float(requests), token_bucket(spec), 0.0)

    async def record_tokens(self, principal: Principal, n: int, limits: KeyLimits | None = None) -> None:
        """Charge ``n`` tokens already generated, in full, whatever the bucket holds: never refused
        (the debt refuses the key's next request). Before 2026-12-07 a charge that found the bucket
        already in debt was dropped, so every answer that ended while the key was in debt was free:
        30 parallel answers against a 600 tokens/min key left its bucket at −15, not −600."""
        if n < 0:
            raise ValueError(f"n: tokens to charge must be >= 0, got {n}")
        spec = self.limits_for(principal, limits)
        await self._take(principal, BucketSpec(0.0, 0.0), 0.0, token_bucket(spec), float(n))

    async def _take(
        self, principal: Principal, req: BucketSpec, req_cost: float, tok: BucketSpec, tok_cost: float
    ) -> None:
        if req.unlimited and tok.unlimited:
            return
        # One hash tag per key: both buckets land in one Redis Cluster slot, so one script sees both.
        tag = f"{{{principal.tenant}:{principal.key_id}}}"
        keys = (f"llm:rl:{tag}:req", f"llm:rl:{tag}:tok")
        allowed, wait_s, reason = await self._take_shared(keys, req, req_cost, tok, tok_cost)
        if allowed:
            return
        what = "requests" if reason == 1 else "tokens"
        RATE_LIMITED.labels(what).inc()
        limit = (
            f"{req.rate_per_s:g} requests/s (burst {req.capacity:g})"
            if reason == 1
            else f"{tok.capacity:g} tokens/min"
        )
        raise errors.Overloaded(
            f"rate limit exceeded for API key {principal.key_id}: {limit}; retry in {wait_s:.2f}s",
            retry_after_s=max(wait_s, 0.001),
        )

    async def _take_shared(
        self, keys: tuple[str, str], req: BucketSpec, req_cost: float, tok: BucketSpec, tok_cost: float
    ) -> tuple[bool, float, int]:
        if self._script is not None:
            now = "" if self._use_redis_time else str(int(self._clock() * 1000))
            args = [now, req.rate_per_s, req.capacity, req_cost, tok.rate_per_s, tok.capacity, tok_cost]
            try:
                allowed, wait_ms, reason = await self._script(keys=list(keys), args=args)
                self._redis_down_logged = False
                return bool(allowed), int(wait_ms) / 1000.0, int(reason)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
                # Limits still hold per router while Redis is away; they just stop being shared.
                if not self._redis_down_logged:
                    log.warning("rate limits fall back to local buckets: Redis unavailable (%s)", exc)
                    self._redis_down_logged = True
        return self._local.take(keys, req, req_cost, tok, tok_cost)


class InflightLimiter:
    """A global cap on requests in flight in this router: excess is refused at once, not queued."""

    def __init__(self, max_in_flight: int, retry_after_s: float = 0.5) -> None:
        if max_in_flight < 1:
            raise ValueError(f"--max-in-flight: must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.in_flight = 0

    def slot(self) -> _Slot:
        """``with limiter.slot():`` holds one of the router's in-flight places (a plain context
        manager, not a generator one: it is on every request's path)."""
        return _Slot(self)


class _Slot:
    __slots__ = ("_limiter",)

    def __init__(self, limiter: InflightLimiter) -> None:
        self._limiter = limiter

    def __enter__(self) -> None:
        limiter = self._limiter
        if limiter.in_flight >= limiter.max_in_flight:
            RATE_LIMITED.labels("in_flight").inc()
            raise errors.Overloaded(
                f"router overloaded: {limiter.in_flight} requests in flight (max {limiter.max_in_flight})",
                retry_after_s=limiter.retry_after_s,
            )
        limiter.in_flight += 1

    def __exit__(self, *exc: object) -> None:
        self._limiter.in_flight -= 1
