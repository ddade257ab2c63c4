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
from redis import exceptions as redis_exceptions

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
    def from_dict(cls, raw: Any) -> ApiKeyRecord:
        """A record from its stored form (a keys-file entry, a Redis value); every way it can be
        malformed (not a mapping, a field of the wrong type) is a ValueError naming the key."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"a key record must be a mapping of fields, got {type(raw).__name__}")
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
            raise ValueError(f"unknown field(s) {sorted(map(str, unknown))} in key {raw.get('id')!r}")
        try:
            limits = KeyLimits(
                requests_per_second=_opt_float(raw.get("requests_per_second")),
                tokens_per_minute=_opt_float(raw.get("tokens_per_minute")),
                burst=None if raw.get("burst") is None else int(raw["burst"]),
            )
        except TypeError as exc:  # "burst": [1], "requests_per_second": {}: a field of the wrong type
            raise ValueError(f"a limit of key {raw.get('id')!r} has the wrong type: {exc}") from exc
        return cls(
            key_id=str(raw.get("id", "")),
            tenant=str(raw.get("tenant", "")),
            key_sha256=str(raw.get("sha256", "")).lower(),
            revoked=bool(raw.get("revoked", False)),
            limits=limits,
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
    """Read a keys file (YAML or JSON: ``{"keys": [ {id, tenant, sha256, …}, … ]}``); a file
    that does not exist holds no keys.

    Every way the file can be malformed is a ValueError, and a file that cannot be read (its
    mode, its owner) an OSError: a reload keeps the keys it has on either (a YAML syntax error, a
    typo in an entry, a file the CLI rewrote as root), where any other error locked every client out.
    """
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


def parse_redis_record(value: bytes | str) -> ApiKeyRecord:
    """One value of the Redis hash ``llm:apikeys`` (the record as JSON); ValueError when malformed."""
    try:
        raw = json.loads(value)
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ValueError(f"not a JSON key record: {exc}") from exc
    return ApiKeyRecord.from_dict(raw)


def redis_field_name(field_name: bytes | str) -> str:
    """A field of ``llm:apikeys`` (a key's SHA-256) as text, for messages."""
    return field_name.decode(errors="replace") if isinstance(field_name, bytes) else str(field_name)


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

    Where the keys come from (the router's flags, ``RouterRuntime``):

    - a keys file (``--api-keys-file``), re-read when it changes, and with ``--redis-url`` the
      keys in Redis as well, refreshed every few seconds: a key is accepted when either holds it
      and refused when either holds it revoked;
    - Redis alone (``--redis-url`` without a keys file, ``from_redis(..., open_tenant_while_empty=)``):
      the keys in the Redis hash ``llm:apikeys``. While that hash holds no record at all the
      router is open (as with no keys anywhere); the first record seen ends open mode for good;
    - neither: open mode, every caller is one tenant, for local use.
    """

    def __init__(
        self,
        records: Iterable[ApiKeyRecord] = (),
        *,
        open_tenant: str | None = None,
        path: Path | None = None,
        redis: Any = None,
        open_tenant_while_empty: str | None = None,
    ) -> None:
        self.open_tenant = open_tenant
        self.path = path
        self.redis = redis
        self._file_records: dict[str, ApiKeyRecord] = {}
        self._redis_records: dict[str, ApiKeyRecord] = {}
        self._mtime: tuple[int, int, int, int] | None = None
        self._refresh_task: asyncio.Task[None] | None = None
        #: Redis alone: the tenant every caller is while ``llm:apikeys`` is empty; None once a
        #: record has been seen there (open mode never comes back) or in any other mode.
        self._open_while_empty = open_tenant_while_empty
        #: False until Redis has been read once, in the Redis-alone mode: callers are refused
        #: (UNAVAILABLE) meanwhile rather than let in by an open mode nobody chose.
        self._loaded = open_tenant_while_empty is None
        #: Malformed Redis records last seen, field → why: each is logged once, not every refresh.
        self._bad_redis: dict[str, str] = {}
        self._warned_empty = False
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
        try:
            if not path.exists():
                raise ValueError(f"--api-keys-file: {path} does not exist")
            version = _file_version(path)
            records = load_key_records(path)
        except OSError as exc:  # its mode or owner: the router runs as another user than the CLI did
            raise ValueError(
                f"--api-keys-file: cannot read {path}: {exc.strerror or exc} (make it readable to the "
                "user the router runs as)"
            ) from None
        auth = cls(records, path=path, redis=redis)
        auth._mtime = version
        return auth

    @classmethod
    def from_redis(cls, redis: Any, *, open_tenant_while_empty: str | None = None) -> Authenticator:
        """Keys live only in Redis; ``await start()`` (or ``refresh()``) loads them.

        ``open_tenant_while_empty``: while the hash ``llm:apikeys`` holds no record every caller is
        this tenant; before the first read every caller is refused (UNAVAILABLE), and once any
        record has been seen keys are required for good, even if the hash is emptied later.
        """
        return cls(redis=redis, open_tenant_while_empty=open_tenant_while_empty)

    @property
    def is_open(self) -> bool:
        return self.open_tenant is not None

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        """The caller's principal; ``Unauthenticated`` when the key is missing, unknown or revoked."""
        if self.open_tenant is not None:
            return Principal(self.open_tenant, ANONYMOUS_KEY_ID)
        if not self._loaded:
            raise errors.DependencyUnavailable("API keys are not loaded from Redis yet: retry shortly")
        token = bearer_token(metadata)
        if token is None:
            raise errors.Unauthenticated("missing API key: send metadata 'authorization: Bearer <api key>'")
        self._reload_file_if_changed()
        digest = hash_key(token)
        found = [
            r
            for r in (self._redis_records.get(digest), self._file_records.get(digest))
            if r is not None and hmac.compare_digest(r.key_sha256, digest)
        ]
        if not found:
            raise errors.Unauthenticated("invalid API key")
        # Revoked in either store is revoked: `keys revoke --file` must stop a key that Redis
        # also holds, and the other way round.
        for record in found:
            if record.revoked:
                raise errors.Unauthenticated(f"API key {record.key_id} has been revoked")
        record = found[0]  # Redis's record first: its limits and tenant, as before
        return Principal(record.tenant, record.key_id, record.limits)

    async def start(self, interval_s: float = 5.0) -> None:
        """Log where the keys come from; with Redis, read the keys there now (a RuntimeError
        naming ``--redis-url`` when it cannot be reached), then every ``interval_s`` in the background."""
        if self.path is not None:
            log.info(
                "API keys: %d from %s%s; keys are required",
                len(self._file_records),
                self.path,
                f" and Redis {REDIS_KEYS_HASH}" if self.redis is not None else "",
            )
        if self.redis is None:
            return
        try:
            await self.refresh()
        except (OSError, redis_exceptions.ConnectionError, redis_exceptions.TimeoutError) as exc:
            raise RuntimeError(
                f"API keys: Redis at --redis-url is unreachable ({exc}): start it, or fix --redis-url "
                "(LLMMESH_REDIS_URL)"
            ) from None
        self.start_refresh(interval_s)

    async def refresh(self) -> None:
        """Re-read keys from the file (if changed) and from Redis."""
        self._reload_file_if_changed()
        if self.redis is None:
            return
        raw: Mapping[Any, Any] = await self.redis.hgetall(REDIS_KEYS_HASH)
        self._set_redis_records(raw)

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

    def _set_redis_records(self, raw: Mapping[Any, Any]) -> None:
        # One malformed record (a hand edit, another tool's) is skipped: it must not stop the
        # others from loading, or a revocation written after it would never take effect.
        records: dict[str, ApiKeyRecord] = {}
        bad: dict[str, str] = {}
        for field_name, value in raw.items():
            name = redis_field_name(field_name)
            try:
                record = parse_redis_record(value)
            except ValueError as exc:
                bad[name] = str(exc)
                if self._bad_redis.get(name) != bad[name]:
                    log.warning(
                        "skipping bad API key record in Redis %s field %s: %s", REDIS_KEYS_HASH, name, exc
                    )
                continue
            kept = records.get(record.key_sha256)
            if kept is None or (record.revoked and not kept.revoked):  # two copies: revoked wins
                records[record.key_sha256] = record
        self._bad_redis = bad
        self._redis_records = records
        self._loaded = True
        if self._open_while_empty is None:
            if not raw and self.path is None and not self._warned_empty:
                self._warned_empty = True
                log.error(
                    "Redis hash %s holds no API keys: every caller is refused (a router that has "
                    "required keys never falls back to open mode)",
                    REDIS_KEYS_HASH,
                )
            elif raw:
                self._warned_empty = False
        elif raw:
            # Any record, even a malformed one, means keys are meant to be required here.
            was_open = self.open_tenant is not None
            self._open_while_empty = self.open_tenant = None
            if was_open:
                log.warning(
                    "API keys appeared in Redis %s: keys are required from now on (open mode ended)",
                    REDIS_KEYS_HASH,
                )
            else:
                log.info("API keys: %d from Redis %s; keys are required", len(records), REDIS_KEYS_HASH)
        elif self.open_tenant is None:
            self.open_tenant = self._open_while_empty
            log.warning(
                "no API keys: no --api-keys-file and Redis %s is empty, so every caller is tenant %r "
                "until a key is added there (llm-mesh keys add --redis-url ...); do not expose this router",
                REDIS_KEYS_HASH,
                self.open_tenant,
            )

    def _reload_file_if_changed(self) -> None:
        if self.path is None:
            return
        try:
            version = _file_version(self.path)
        except OSError:
            return  # keep the keys we have rather than lock everyone out
        if version == self._mtime:
            return
        # Tried once per version of the file (a chmod or chown is a new one): a file that cannot
        # be used is logged once, not on every request, and the keys it replaced stay in force.
        self._mtime = version
        try:
            self._set_file_records(load_key_records(self.path))
            log.info("reloaded API keys from %s", self.path)
        except ValueError as exc:
            log.error("keeping previous API keys: %s", exc)
        except OSError as exc:  # e.g. the keys CLI, run as root, left it unreadable to the router
            log.error(
                "keeping previous API keys: cannot read --api-keys-file %s: %s (make it readable to "
                "the user the router runs as)",
                self.path,
                exc.strerror or exc,
            )


def _file_version(path: Path) -> tuple[int, int, int, int]:
    # The keys CLI replaces the file (new inode), so this changes even within one mtime tick; the
    # ctime changes with a chmod or chown too, so a file made readable again is read again.
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_ino, st.st_size, st.st_ctime_ns)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
