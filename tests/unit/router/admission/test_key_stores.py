"""Where the router's API keys live and what survives a bad store: an unreadable keys file, a
malformed record in Redis, keys kept in Redis alone, one id twice, a key revoked in one store only."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from services.common import errors
from services.router.admission.auth import (
    REDIS_KEYS_HASH,
    ApiKeyRecord,
    Authenticator,
    Principal,
    hash_key,
)
from services.router.admission.keys import add_key, revoke_key
from services.router.api.openai.app import OpenAiFront
from services.router.placement.models import ModelCatalog
from services.router.runtime import RouterRuntime, RouterSettings
from tests.support.redis import RedisServer

ROOT = Path(__file__).resolve().parents[4]
KEYS_CLI = [sys.executable, "-m", "services.router.admission.keys"]


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def record_json(key_id: str, tenant: str, key: str, *, revoked: bool = False) -> str:
    return json.dumps(ApiKeyRecord(key_id, tenant, hash_key(key), revoked).to_dict())


class FakeRedis:
    """The one call the authenticator makes: HGETALL of the key hash."""

    def __init__(self, records: dict[str, Any] | None = None) -> None:
        self.hash: dict[str, Any] = dict(records or {})

    async def hgetall(self, name: str) -> dict[str, Any]:
        return dict(self.hash) if name == REDIS_KEYS_HASH else {}


async def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, [*KEYS_CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


# -- 1. a keys file the router cannot read


def _unreadable(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """``path`` reads as it would to a router running unprivileged after root's CLI wrote it 0600
    (these tests may run as root, which no file mode stops)."""
    real = Path.read_text

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        if self == path:
            raise PermissionError(13, "Permission denied", str(path))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)


class _Pool:
    def models(self) -> set[str]:
        return {"m"}


class _Pipeline:
    class s:  # the attribute TurnPipeline has
        pool = _Pool()
        catalog = ModelCatalog()


async def test_a_keys_file_that_became_unreadable_keeps_the_keys_it_had(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every request was HTTP 500 / INTERNAL "PermissionError: … keys.yaml" (the path leaked to
    clients), a wrong key included; now the keys read last stay in force and it is logged once."""
    path = tmp_path / "keys.yaml"
    key, _ = add_key(path, "acme", "acme-1")
    auth = Authenticator.from_file(path)
    globex, _ = add_key(path, "globex", "globex-1")  # the file changes: the next request re-reads it
    _unreadable(monkeypatch, path)
    front = OpenAiFront(_Pipeline(), auth)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=front.app())
    with caplog.at_level(logging.ERROR, logger="llmmesh.router.auth"):
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
            ok = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            wrong = await client.get("/v1/models", headers={"Authorization": "Bearer llmk_wrong"})
            again = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert ok.status_code == 200 and again.status_code == 200
    assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "invalid API key"
    assert str(path) not in wrong.text
    logged = [r.getMessage() for r in caplog.records if "keeping previous API keys" in r.getMessage()]
    assert len(logged) == 1 and str(path) in logged[0] and "Permission denied" in logged[0]

    # Made readable again (a chmod changes only the file's ctime): read again, the new key works.
    with pytest.raises(errors.Unauthenticated, match="invalid API key"):
        auth.authenticate(bearer(globex))
    monkeypatch.undo()
    await asyncio.sleep(0.05)  # past the kernel's coarse timestamp tick
    os.chmod(path, 0o640)
    assert auth.authenticate(bearer(key)).key_id == "acme-1"
    assert auth.authenticate(bearer(globex)).key_id == "globex-1"


def test_an_unreadable_keys_file_at_start_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "keys.yaml"
    add_key(path, "acme", "acme-1")
    _unreadable(monkeypatch, path)
    # A ValueError: the router's command line reports it as an error naming the flag, and exits.
    with pytest.raises(ValueError, match=r"--api-keys-file: cannot read .*keys\.yaml: Permission denied"):
        Authenticator.from_file(path)


def test_the_keys_cli_keeps_the_files_mode_and_owner(tmp_path: Path) -> None:
    """`keys add` (or revoke) rewrote every file 0600 as whoever ran it: a router running as
    another user then failed every request."""
    path = tmp_path / "keys.yaml"
    add_key(path, "acme", "acme-1")
    assert path.stat().st_mode & 0o777 == 0o600  # a new file is private
    os.chmod(path, 0o640)
    owner: tuple[int, int] | None = None
    if os.geteuid() == 0:
        owner = (65534, 65534)  # the router's user, as an operator set it up
        os.chown(path, *owner)
    add_key(path, "globex", "globex-1")
    revoke_key(path, "acme-1")
    st = path.stat()
    assert st.st_mode & 0o777 == 0o640
    if owner is not None:
        assert (st.st_uid, st.st_gid) == owner
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".keys.yaml.")]  # no temp left


# -- 2. a malformed record in Redis


BAD_RECORDS: dict[str, str | bytes] = {
    "b" * 64: json.dumps({"id": "k2", "tenant": "t", "sha256": "a" * 64, "burst": [1]}),
    "c" * 64: json.dumps([1, 2]),
    "d" * 64: json.dumps(7),
    "e" * 64: b"\xff not json",
    "f" * 64: json.dumps({"id": "k3", "tenant": "t", "sha256": "a" * 64, "requests_per_second": {}}),
}


async def test_a_malformed_record_in_redis_does_not_stop_revocations(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One bad record made every refresh raise, so a key revoked afterwards stayed accepted."""
    key, other = "llmk_victim", "llmk_other"
    redis = FakeRedis(
        {hash_key(key): record_json("acme-1", "acme", key), hash_key(other): record_json("o-1", "o", other)}
    )
    auth = Authenticator.from_redis(redis)
    await auth.refresh()
    assert auth.authenticate(bearer(key)) == Principal("acme", "acme-1")
    redis.hash.update(BAD_RECORDS)
    redis.hash[hash_key(key)] = record_json("acme-1", "acme", key, revoked=True)
    with caplog.at_level(logging.WARNING, logger="llmmesh.router.auth"):
        await auth.refresh()
        await auth.refresh()
    with pytest.raises(errors.Unauthenticated, match="acme-1 has been revoked"):
        auth.authenticate(bearer(key))
    assert auth.authenticate(bearer(other)).key_id == "o-1"
    warned = [r.getMessage() for r in caplog.records if "skipping bad API key record" in r.getMessage()]
    assert len(warned) == len(BAD_RECORDS)  # each once, not on every refresh
    assert any("b" * 64 in w and "has the wrong type" in w for w in warned)


async def test_the_keys_cli_reports_a_malformed_redis_record_and_goes_on(redis_server: RedisServer) -> None:
    """`keys list/revoke --redis-url` ended in a TypeError traceback on one bad record."""
    client = aioredis.from_url(redis_server.url, socket_timeout=5, socket_connect_timeout=2)
    try:
        for field_name, value in BAD_RECORDS.items():
            await client.hset(REDIS_KEYS_HASH, field_name, value)
        added = await cli("add", "--redis-url", redis_server.url, "--tenant", "acme", "--id", "acme-1")
        assert added.returncode == 0, added.stderr
        key = added.stdout.strip()

        listed = await cli("list", "--redis-url", redis_server.url)
        assert listed.returncode == 0, listed.stderr
        assert [json.loads(line)["id"] for line in listed.stdout.splitlines()] == ["acme-1"]
        assert listed.stderr.count("warning: skipping malformed record") == len(BAD_RECORDS)
        assert "b" * 64 in listed.stderr and "Traceback" not in listed.stderr

        revoked = await cli("revoke", "--redis-url", redis_server.url, "--id", "acme-1")
        assert revoked.returncode == 0, revoked.stderr
        assert "revoked acme-1 (tenant acme)" in revoked.stdout and "Traceback" not in revoked.stderr
        auth = Authenticator.from_redis(client)
        await auth.refresh()
        with pytest.raises(errors.Unauthenticated, match="acme-1 has been revoked"):
            auth.authenticate(bearer(key))
    finally:
        await client.aclose()


# -- 3. keys kept in Redis alone


async def test_keys_in_redis_alone_are_required_once_there_is_one(caplog: pytest.LogCaptureFixture) -> None:
    redis = FakeRedis()
    auth = Authenticator.from_redis(redis, open_tenant_while_empty="default")
    # Before Redis has been read nobody is let in: not even as the open tenant.
    with pytest.raises(errors.DependencyUnavailable, match="not loaded"):
        auth.authenticate([])
    with caplog.at_level(logging.INFO, logger="llmmesh.router.auth"):
        await auth.start(interval_s=3600)
        try:
            assert auth.is_open and auth.authenticate([]) == Principal("default", "anonymous")
            assert any("every caller is tenant 'default'" in r.getMessage() for r in caplog.records)

            key = "llmk_acme"
            redis.hash[hash_key(key)] = record_json("acme-1", "acme", key)  # `keys add --redis-url`
            await auth.refresh()
            assert not auth.is_open
            assert any("open mode ended" in r.getMessage() for r in caplog.records)
            with pytest.raises(errors.Unauthenticated, match="missing API key"):
                auth.authenticate([])
            with pytest.raises(errors.Unauthenticated, match="invalid API key"):
                auth.authenticate(bearer("not-a-key-at-all"))
            assert auth.authenticate(bearer(key)) == Principal("acme", "acme-1")

            redis.hash.clear()  # a flushed or replaced Redis must not open the router
            await auth.refresh()
            assert not auth.is_open
            with pytest.raises(errors.Unauthenticated):
                auth.authenticate([])
        finally:
            await auth.close()


async def test_a_malformed_record_alone_still_means_keys_are_required() -> None:
    auth = Authenticator.from_redis(FakeRedis(BAD_RECORDS), open_tenant_while_empty="default")
    await auth.refresh()
    assert not auth.is_open
    with pytest.raises(errors.Unauthenticated):
        auth.authenticate(bearer("anything"))


async def test_a_router_with_redis_and_no_keys_file_requires_the_keys_in_redis(
    redis_server: RedisServer,
) -> None:
    """docs/router-frontdoor.md: keys may be kept in Redis instead of a file. A router given
    --redis-url and no --api-keys-file ignored them and let anyone in as tenant 'default'."""
    added = await cli("add", "--redis-url", redis_server.url, "--tenant", "acme", "--id", "acme-r")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    runtime = RouterRuntime(RouterSettings(replicas=("127.0.0.1:9",), redis_url=redis_server.url))
    auth = runtime.authenticator
    try:
        assert not auth.is_open
        await auth.start()
        assert not auth.is_open
        with pytest.raises(errors.Unauthenticated, match="invalid API key"):
            auth.authenticate(bearer("not-a-key-at-all"))
        with pytest.raises(errors.Unauthenticated, match="missing API key"):
            auth.authenticate([])
        assert auth.authenticate(bearer(key)) == Principal("acme", "acme-r")
    finally:
        await auth.close()
        await runtime.redis.aclose()


async def test_an_unreachable_redis_at_start_is_an_error_naming_the_flag() -> None:
    auth = Authenticator.from_redis(
        aioredis.from_url("redis://127.0.0.1:9", socket_timeout=1, socket_connect_timeout=1),
        open_tenant_while_empty="default",
    )
    try:
        with pytest.raises(RuntimeError, match="--redis-url"):
            await auth.start()
        assert not auth.is_open
    finally:
        await auth.redis.aclose()


# -- 4. one id twice in Redis


async def test_keys_add_refuses_an_id_redis_already_has_and_revoke_takes_every_copy(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    first = await cli("add", "--redis-url", url, "--tenant", "acme", "--id", "acme-web")
    assert first.returncode == 0, first.stderr
    dup = await cli("add", "--redis-url", url, "--tenant", "acme", "--id", "acme-web")
    assert dup.returncode == 2 and "'acme-web' already exists" in dup.stderr and not dup.stdout.strip()

    # Two copies written before ids were checked (or by hand): revoke must take both.
    client = aioredis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
    try:
        second = "llmk_second_copy"
        await client.hset(REDIS_KEYS_HASH, hash_key(second), record_json("acme-web", "acme", second))
        listed = await cli("list", "--redis-url", url)
        assert [json.loads(line)["id"] for line in listed.stdout.splitlines()] == ["acme-web", "acme-web"]
        revoked = await cli("revoke", "--redis-url", url, "--id", "acme-web")
        assert revoked.returncode == 0, revoked.stderr
        assert revoked.stdout.count("revoked acme-web") == 2
        auth = Authenticator.from_redis(client)
        await auth.refresh()
        for key in (first.stdout.strip(), second):
            with pytest.raises(errors.Unauthenticated, match="acme-web has been revoked"):
                auth.authenticate(bearer(key))
    finally:
        await client.aclose()


# -- 5. a key revoked in one store only


async def test_a_key_revoked_in_either_store_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    key, record = add_key(path, "acme", "acme-web")
    redis = FakeRedis({record.key_sha256: json.dumps(record.to_dict())})  # the same key in Redis too
    auth = Authenticator.from_file(path, redis=redis)
    await auth.refresh()
    assert auth.authenticate(bearer(key)).key_id == "acme-web"

    revoke_key(path, "acme-web")  # `keys revoke --file`; Redis still holds it unrevoked
    await auth.refresh()
    with pytest.raises(errors.Unauthenticated, match="acme-web has been revoked"):
        auth.authenticate(bearer(key))

    # And the other way round: revoked in Redis, live in the file.
    key2, record2 = add_key(path, "acme", "acme-api")
    redis.hash[record2.key_sha256] = record_json("acme-api", "acme", key2, revoked=True)
    await auth.refresh()
    with pytest.raises(errors.Unauthenticated, match="acme-api has been revoked"):
        auth.authenticate(bearer(key2))
