"""API-key authentication at the front door: key → tenant, and internal metadata stripped.

Keys are never stored: the keys file (or Redis) holds the SHA-256 of each key.
A caller's key is hashed and looked up by that hash; since the hash of a secret
reveals nothing usable about the secret, a dict look-up by hash is safe, and the
final comparison is still constant-time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.common import errors
from services.common.metadata import AUTHORIZATION_KEY, TENANT_KEY, USER_KEY

log = logging.getLogger("llmmesh.router.auth")

# Redis hash of every key record: field = key SHA-256 (hex), value = JSON record.
REDIS_KEYS_HASH = "llm:apikeys"
INTERNAL_PREFIX = "x-llmmesh-"
ANONYMOUS_KEY_ID = "anonymous"


@dataclass(frozen=True)
class KeyLimits:
    """Per-key rate limits; None means no limit of that kind."""

    requests_per_second: float | None = None
    tokens_per_minute: float | None = None
    # Requests a key may send at once before the per-second rate applies.
    burst: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_second", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}: must be > 0 (leave it out for no limit), got {value}")
        if self.burst is not None and self.burst < 1:
            raise ValueError(f"burst: must be >= 1, got {self.burst}")


UNLIMITED = KeyLimits()


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant that owns the data, and which key was used."""

    tenant: str
    key_id: str
    limits: KeyLimits = field(default=UNLIMITED, compare=False)


#: The longest tenant name: what the session service takes as an owner (its check_owner).
MAX_TENANT_CHARS = 256


@dataclass(frozen=True)
class ApiKeyRecord:
    """One stored key: its hash, never the key."""

    key_id: str
    tenant: str
    key_sha256: str
    revoked: bool = False
    limits: KeyLimits = UNLIMITED

    def __post_init__(self) -> None:
        if not self.key_id:
            raise ValueError("id: must not be empty")
        if not self.tenant:
            raise ValueError(f"tenant: must not be empty (key {self.key_id})")
        # The tenant travels as gRPC metadata (x-llmmesh-tenant) to the session service and the
        # retriever, which take 1-256 printable ASCII characters: "Société" failed every one of
        # that key's session turns (an illegal header value, INTERNAL), blaming its session_id.
        if (
            len(self.tenant) > MAX_TENANT_CHARS
            or not all(" " <= c <= "~" for c in self.tenant)
            or self.tenant != self.tenant.strip()
        ):
            raise ValueError(
                f"tenant: must be 1-{MAX_TENANT_CHARS} printable ASCII characters, without spaces at "
                f"either end (key {self.key_id}, tenant {self.tenant[:40]!r})"
            )
        if len(self.key_sha256) != 64 or any(c not in "0123456789abcdef" for c in self.key_sha256):
            raise ValueError(f"sha256: must be 64 lowercase hex digits (key {self.key_id})")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ApiKeyRecord:
        unknown = set(raw) - {
            "id",
            "tenant",
            "sha256",
            "revoked",
            "requests_per_second",
            "tokens_per_minute",
            "burst",
            "created_at",
        }
        if unknown:
            raise ValueError(f"keys file: unknown field(s) {sorted(unknown)} in key {raw.get('id')!r}")
        return cls(
            key_id=str(raw.get("id", "")),
            tenant=str(raw.get("tenant", "")),
            key_sha256=str(raw.get("sha256", "")).lower(),
            revoked=bool(raw.get("revoked", False)),
            limits=KeyLimits(
                requests_per_second=_opt_float(raw.get("requests_per_second")),
                tokens_per_minute=_opt_float(raw.get("tokens_per_minute")),
                burst=None if raw.get("burst") is None else int(raw["burst"]),
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.key_id,
            "tenant": self.tenant,
            "sha256": self.key_sha256,
            "revoked": self.revoked,
        }
        for name in ("requests_per_second", "tokens_per_minute", "burst"):
            value = getattr(self.limits, name)
            if value is not None:
                out[name] = value
        return out


def hash_key(key: str) -> str:
    """The SHA-256 (hex) under which a key is stored."""
    return hashlib.sha256(key.encode()).hexdigest()


def load_key_records(path: Path) -> list[ApiKeyRecord]:
    """Read a keys file (YAML or JSON: ``{"keys": [ {id, tenant, sha256, …}, … ]}``)."""
    # Every way the file can be malformed is a ValueError: a reload keeps the keys it has on one
    # (a YAML syntax error, a typo in an entry), where any other error locked every client out.
    text = path.read_text() if path.exists() else ""
    try:
        raw = (json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    if raw is None:
        return []
    if not isinstance(raw, dict) or not isinstance(raw.get("keys", []), list):
        raise ValueError(f"{path}: expected a mapping with a 'keys' list")
    try:
        records = [ApiKeyRecord.from_dict(item) for item in raw.get("keys") or []]
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: a key entry is malformed ({type(exc).__name__}: {exc})") from exc
    ids = [r.key_id for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate key ids")
    return records


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The key from ``authorization: Bearer <key>``, or None when absent."""
    for k, v in metadata or ():
        if k.lower() == AUTHORIZATION_KEY:
            value = v.decode() if isinstance(v, bytes) else v
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise errors.Unauthenticated("authorization: expected 'Bearer <api key>'")
            return token.strip()
    return None


def strip_internal(metadata: Iterable[tuple[str, str | bytes]] | None) -> list[tuple[str, str]]:
    """Client metadata that may travel downstream: no ``x-llmmesh-*`` (the router sets
    those itself), no ``authorization`` (a client's secret stays at the front door), and no
    binary ``-bin`` entries (only text metadata is forwarded)."""
    kept: list[tuple[str, str]] = []
    for k, v in metadata or ():
        key = k.lower()
        if key.startswith(INTERNAL_PREFIX) or key == AUTHORIZATION_KEY or key.endswith("-bin"):
            continue
        kept.append((key, v.decode() if isinstance(v, bytes) else v))
    return kept


def downstream_metadata(principal: Principal) -> tuple[tuple[str, str], ...]:
    """Metadata the router attaches to calls to session/retriever on behalf of ``principal``."""
    return ((TENANT_KEY, principal.tenant), (USER_KEY, principal.key_id))


class Authenticator:
    """Turns ``authorization`` metadata into a ``Principal``.

    Open mode (no keys configured) admits everyone as one tenant, for local use.
    With a keys file the file is re-read when it changes; with Redis, keys added
    by ``keys.py --redis-url`` are picked up by ``refresh()``.
    """

    def __init__(
        self,
        records: Iterable[ApiKeyRecord] = (),
        *,
        open_tenant: str | None = None,
        path: Path | None = None,
        redis: Any = None,
    ) -> None:
        self.open_tenant = open_tenant
        self.path = path
        self.redis = redis
        self._file_records: dict[str, ApiKeyRecord] = {}
        self._redis_records: dict[str, ApiKeyRecord] = {}
        self._mtime: tuple[int, int, int] | None = None
        self._refresh_task: asyncio.Task[None] | None = None
        self._set_file_records(records)

    @classmethod
    def open(cls, default_tenant: str = "default") -> Authenticator:
        log.warning(
            "no API keys configured: every caller is tenant %r (do not expose this router)", default_tenant
        )
        return cls(open_tenant=default_tenant)

    @classmethod
    def from_file(cls, path: str | Path, redis: Any = None) -> Authenticator:
        path = Path(path)
        if not path.exists():
            raise ValueError(f"--api-keys-file: {path} does not exist")
        auth = cls(load_key_records(path), path=path, redis=redis)
        auth._mtime = _file_version(path)
        return auth

    @classmethod
    def from_redis(cls, redis: Any) -> Authenticator:
        """Keys live only in Redis; call ``await refresh()`` (or ``start_refresh``) to load them."""
        return cls(redis=redis)

    @property
    def is_open(self) -> bool:
        return self.open_tenant is not None

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        """The caller's principal; ``Unauthenticated`` when the key is missing, unknown or revoked."""
        if self.open_tenant is not None:
            return Principal(self.open_tenant, ANONYMOUS_KEY_ID)
        token = bearer_token(metadata)
        if token is None:
            raise errors.Unauthenticated("missing API key: send metadata 'authorization: Bearer <api key>'")
        self._reload_file_if_changed()
        digest = hash_key(token)
        record = self._redis_records.get(digest) or self._file_records.get(digest)
        if record is None or not hmac.compare_digest(record.key_sha256, digest):
            raise errors.Unauthenticated("invalid API key")
        if record.revoked:
            raise errors.Unauthenticated(f"API key {record.key_id} has been revoked")
        return Principal(record.tenant, record.key_id, record.limits)

    async def refresh(self) -> None:
        """Re-read keys from the file (if changed) and from Redis."""
        self._reload_file_if_changed()
        if self.redis is None:
            return
        raw = await self.redis.hgetall(REDIS_KEYS_HASH)
        records: dict[str, ApiKeyRecord] = {}
        for value in raw.values():
            try:
                record = ApiKeyRecord.from_dict(json.loads(value))
            except ValueError as exc:
                log.error("skipping bad key record in Redis: %s", exc)
                continue
            records[record.key_sha256] = record
        self._redis_records = records

    def start_refresh(self, interval_s: float = 5.0) -> None:
        """Refresh in the background so revocations reach every router within ``interval_s``."""

        async def loop() -> None:
            while True:
                try:
                    await self.refresh()
                except Exception as exc:  # a Redis blip must not kill the loop; keep the last keys
                    log.warning("API key refresh failed: %s", exc)
                await asyncio.sleep(interval_s)

        if self._refresh_task is None:
            self._refresh_task = asyncio.create_task(loop(), name="api-key-refresh")

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh_task
            self._refresh_task = None

    def _set_file_records(self, records: Iterable[ApiKeyRecord]) -> None:
        self._file_records = {r.key_sha256: r for r in records}

    def _reload_file_if_changed(self) -> None:
        if self.path is None:
            return
        try:
            mtime = _file_version(self.path)
        except OSError:
            return  # keep the keys we have rather than lock everyone out
        if mtime == self._mtime:
            return
        try:
            self._set_file_records(load_key_records(self.path))
            self._mtime = mtime
            log.info("reloaded API keys from %s", self.path)
        except ValueError as exc:
            log.error("keeping previous API keys: %s", exc)


def _file_version(path: Path) -> tuple[int, int, int]:
    # The keys CLI replaces the file (new inode), so this changes even within one mtime tick.
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_ino, st.st_size)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
