"""Session → replica pins, shared through Redis so every router sends a session to one replica."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("llmmesh.router.pins")

PIN_PREFIX = "llm:pin:"


class AffinityPins:
    """Where each session's KV prefix is warm. Redis when configured, else this router's memory.

    A Redis outage must not fail a turn: the pin is a hint, so errors fall back
    to the local table (and the ring, which every router computes alike).
    """

    def __init__(self, redis: Any = None, ttl_s: int = 3600, max_local: int = 100_000) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self.max_local = max_local
        self._local: dict[str, tuple[str, float]] = {}

    @staticmethod
    def key(tenant: str, session_id: str) -> str:
        return f"{PIN_PREFIX}{tenant}:{session_id}"

    async def get(self, tenant: str, session_id: str) -> str | None:
        key = self.key(tenant, session_id)
        if self.redis is not None:
            try:
                value = await self.redis.get(key)
                if value is not None:
                    return value.decode() if isinstance(value, bytes) else str(value)
                return None
            except Exception as exc:  # any Redis failure: fall back to the local hint
                log.debug("pin lookup failed: %s", exc)
        found = self._local.get(key)
        if found is None or found[1] < time.monotonic():
            return None
        return found[0]

    async def set(self, tenant: str, session_id: str, address: str) -> None:
        key = self.key(tenant, session_id)
        if len(self._local) >= self.max_local:
            self._local.clear()  # a hint table: forgetting is cheap, growing without bound is not
        self._local[key] = (address, time.monotonic() + self.ttl_s)
        if self.redis is not None:
            try:
                await self.redis.set(key, address, ex=self.ttl_s)
            except Exception as exc:
                log.debug("pin store failed: %s", exc)
