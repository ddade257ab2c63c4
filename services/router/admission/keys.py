"""Manage API keys: ``llm-mesh keys add|revoke|list`` (or ``python -m services.router.admission.keys``).

Only SHA-256 hashes are stored. Without ``--file`` or ``--redis-url`` the keys go to
``data/keys.yaml`` in the checkout, beside the rest of what ``llm-mesh up`` keeps (git-ignored),
which is what ``llm-mesh up --api-keys-file data/keys.yaml`` reads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import stat
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis.exceptions
import yaml

from services.common.redact import masked_url
from services.router.admission.auth import (
    REDIS_KEYS_HASH,
    ApiKeyRecord,
    KeyLimits,
    hash_key,
    load_key_records,
    parse_redis_record,
    redis_field_name,
)

KEY_PREFIX = "llmk_"
#: Where keys go when neither --file nor --redis-url is given: the checkout's data/ folder.
DEFAULT_KEYS_FILE = Path(__file__).resolve().parents[3] / "data" / "keys.yaml"


def new_key() -> str:
    """A fresh API key: 32 random bytes, URL-safe, with a prefix that makes leaks greppable."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def write_key_records(path: Path, records: list[ApiKeyRecord]) -> None:
    """Write the keys file atomically (temp file + rename), so a router never reads half a file.

    A file that exists keeps its mode, and its owner and group when this runs as root (else its
    group where this user may set it): the router usually runs as another user, and a file
    rewritten 0600 by root locked it out of every key. A new file is created 0600.
    """
    doc = {"keys": [r.to_dict() for r in records]}
    text = (
        json.dumps(doc, indent=2) + "\n" if path.suffix == ".json" else yaml.safe_dump(doc, sort_keys=False)
    )
    try:
        before: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        before = None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if before is None:
            os.chmod(tmp, 0o600)
        else:
            _keep_owner(tmp, before)
            os.chmod(tmp, stat.S_IMODE(before.st_mode))  # after chown, which may clear set-id bits
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _keep_owner(tmp: str, before: os.stat_result) -> None:
    if (before.st_uid, before.st_gid) == (os.geteuid(), os.getegid()):
        return
    if os.geteuid() == 0:
        os.chown(tmp, before.st_uid, before.st_gid)
        return
    with contextlib.suppress(OSError):  # only a group this user belongs to may be set
        os.chown(tmp, -1, before.st_gid)


def add_key(
    path: Path, tenant: str, key_id: str | None = None, limits: KeyLimits | None = None
) -> tuple[str, ApiKeyRecord]:
    """Create a key for ``tenant`` in the keys file; returns (the key, its stored record)."""
    records = load_key_records(path)
    key_id = key_id or f"{tenant}-{secrets.token_hex(4)}"
    if any(r.key_id == key_id for r in records):
        raise ValueError(f"--id: key id {key_id!r} already exists in {path}")
    key = new_key()
    record = ApiKeyRecord(
        key_id=key_id, tenant=tenant, key_sha256=hash_key(key), limits=limits or KeyLimits()
    )
    write_key_records(path, [*records, record])
    return key, record


def revoke_key(path: Path, key_id: str) -> ApiKeyRecord:
    """Mark a key revoked (kept in the file so the id is not reused by mistake)."""
    records = load_key_records(path)
    for i, r in enumerate(records):
        if r.key_id == key_id:
            revoked = ApiKeyRecord(r.key_id, r.tenant, r.key_sha256, True, r.limits)
            records[i] = revoked
            write_key_records(path, records)
            return revoked
    raise ValueError(f"--id: no key {key_id!r} in {path}")


#: How long one connection attempt or reply may take: a Redis behind a dropped route (packets
#: vanish, nothing refuses) is reported after this instead of the command hanging for good.
REDIS_TIMEOUT_S = 5.0


class RedisUnreachable(Exception):
    """Redis at ``--redis-url`` could not be reached or refused the command (exit status 1)."""


def _client(url: str, cluster: bool) -> Any:
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster

    options = {"socket_connect_timeout": REDIS_TIMEOUT_S, "socket_timeout": REDIS_TIMEOUT_S}
    try:
        return RedisCluster.from_url(url, **options) if cluster else aioredis.from_url(url, **options)
    except ValueError as exc:  # a malformed URL: the caller's usage error (exit 2)
        raise ValueError(f"--redis-url {masked_url(url)}: {exc}") from None


def _in_redis(url: str, work: Any) -> Any:
    """Run the coroutine ``work`` against Redis; a Redis that cannot be had is ``RedisUnreachable``
    naming the URL (it was a traceback: a connection error out of ``asyncio.run``)."""
    try:
        return asyncio.run(work)
    except (
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        # --redis-cluster: no node answered (not a RedisError subclass).
        redis.exceptions.RedisClusterException,
        OSError,
    ) as exc:
        raise RedisUnreachable(
            f"cannot reach Redis at --redis-url {masked_url(url)}: {_one_line(exc)}"
        ) from None
    except redis.exceptions.RedisError as exc:  # reached, but it refused (a read-only replica, …)
        raise RedisUnreachable(f"Redis at --redis-url {masked_url(url)} refused: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


# Adds the record unless a record in the hash already has its id, in one step: two `keys add
# --id X` at once cannot both succeed. A value that is not a JSON object is skipped, as the
# router skips it. KEYS[1] the hash; ARGV: the new record's field (its key's hash), JSON, id.
_ADD_UNLESS_ID_TAKEN = """
for _, value in ipairs(redis.call('HVALS', KEYS[1])) do
  local ok, record = pcall(cjson.decode, value)
  if ok and type(record) == 'table' and record['id'] ~= nil and tostring(record['id']) == ARGV[3] then
    return 0
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


async def _store_in_redis(url: str, cluster: bool, record: ApiKeyRecord) -> None:
    client = _client(url, cluster)
    try:
        added = await client.eval(
            _ADD_UNLESS_ID_TAKEN,
            1,
            REDIS_KEYS_HASH,
            record.key_sha256,
            json.dumps(record.to_dict()),
            record.key_id,
        )
    finally:
        await client.aclose()
    if not added:
        raise ValueError(f"--id: key id {record.key_id!r} already exists in Redis {REDIS_KEYS_HASH}")


def _warn_bad_record(field_name: Any, exc: ValueError) -> None:
    print(
        f"warning: skipping malformed record in Redis {REDIS_KEYS_HASH} field "
        f"{redis_field_name(field_name)}: {exc}",
        file=sys.stderr,
    )


async def _revoke_in_redis(url: str, cluster: bool, key_id: str) -> list[ApiKeyRecord]:
    """Revoke every record with id ``key_id`` (before ids were checked, one id could have several)."""
    client = _client(url, cluster)
    revoked: list[ApiKeyRecord] = []
    try:
        for digest, value in (await client.hgetall(REDIS_KEYS_HASH)).items():
            try:
                record = parse_redis_record(value)
            except ValueError as exc:
                _warn_bad_record(digest, exc)
                # A malformed record of this id is marked too (the router skips it meanwhile), so
                # a later fix of its fields does not bring a revoked key back.
                raw = _json_object(value)
                if raw is not None and str(raw.get("id")) == key_id and raw.get("revoked") is not True:
                    await client.hset(REDIS_KEYS_HASH, digest, json.dumps({**raw, "revoked": True}))
                continue
            if record.key_id == key_id:
                record = ApiKeyRecord(record.key_id, record.tenant, record.key_sha256, True, record.limits)
                await client.hset(REDIS_KEYS_HASH, digest, json.dumps(record.to_dict()))
                revoked.append(record)
    finally:
        await client.aclose()
    if not revoked:
        raise ValueError(f"--id: no key {key_id!r} in Redis {REDIS_KEYS_HASH}")
    return revoked


def _json_object(value: bytes | str) -> dict[str, Any] | None:
    try:
        raw = json.loads(value)
    except ValueError:
        return None
    return raw if isinstance(raw, dict) else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add", help="create a key; prints it once")
    add.add_argument("--tenant", required=True, help="tenant the key acts for")
    add.add_argument("--id", dest="key_id", help="key id (default: <tenant>-<random>)")
    add.add_argument("--requests-per-second", type=float, help="request rate limit")
    add.add_argument("--tokens-per-minute", type=float, help="token rate limit")
    add.add_argument("--burst", type=int, help="requests allowed at once above the rate")
    revoke = sub.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("--id", dest="key_id", required=True, help="key id")
    sub.add_parser("list", help="list key ids, tenants and limits (never keys)")
    for p in sub.choices.values():
        where = p.add_mutually_exclusive_group()
        where.add_argument(
            "--file",
            type=Path,
            help=f"keys file (YAML, or JSON by .json suffix); default {DEFAULT_KEYS_FILE} unless --redis-url",
        )
        where.add_argument(
            "--redis-url",
            help=f"keys in Redis (hash {REDIS_KEYS_HASH}) instead of a file: a router given the same "
            "--redis-url and no --api-keys-file requires them",
        )
        p.add_argument("--redis-cluster", action="store_true", help="--redis-url names a Redis Cluster node")


def run(args: argparse.Namespace) -> int:
    if args.file is None and args.redis_url is None:
        args.file = DEFAULT_KEYS_FILE
    try:
        if args.action == "add":
            limits = KeyLimits(args.requests_per_second, args.tokens_per_minute, args.burst)
            if args.file is not None:
                key, record = add_key(args.file, args.tenant, args.key_id, limits)
            else:
                key = new_key()
                record = ApiKeyRecord(
                    args.key_id or f"{args.tenant}-{secrets.token_hex(4)}",
                    args.tenant,
                    hash_key(key),
                    False,
                    limits,
                )
                _in_redis(args.redis_url, _store_in_redis(args.redis_url, args.redis_cluster, record))
            # The key itself is shown exactly once; only its hash is kept.
            print(key)
            print(f"created key id={record.key_id} tenant={record.tenant} at {_now()}", file=sys.stderr)
        elif args.action == "revoke":
            if args.file is not None:
                revoked = [revoke_key(args.file, args.key_id)]
            else:
                revoked = _in_redis(
                    args.redis_url, _revoke_in_redis(args.redis_url, args.redis_cluster, args.key_id)
                )
            for record in revoked:
                print(f"revoked {record.key_id} (tenant {record.tenant})")
        else:
            records = (
                load_key_records(args.file)
                if args.file is not None
                else _in_redis(args.redis_url, _list_redis(args.redis_url, args.redis_cluster))
            )
            for r in records:
                print(json.dumps({k: v for k, v in r.to_dict().items() if k != "sha256"}))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RedisUnreachable as exc:
        # As the terminal clients do: 2 for what the caller must change, 1 for a service not there.
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


async def _list_redis(url: str, cluster: bool) -> list[ApiKeyRecord]:
    client = _client(url, cluster)
    try:
        values: dict[Any, Any] = await client.hgetall(REDIS_KEYS_HASH)
    finally:
        await client.aclose()
    records = []
    for field_name, value in values.items():
        try:
            records.append(parse_redis_record(value))
        except ValueError as exc:  # reported, and the others still listed
            _warn_bad_record(field_name, exc)
    return records


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.router.admission.keys", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
