"""API keys: hashed storage, bearer parsing, revocation, tenant binding, metadata stripping, the keys CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import yaml

from services.common import errors
from services.router.admission.auth import (
    Authenticator,
    KeyLimits,
    Principal,
    downstream_metadata,
    hash_key,
    strip_internal,
)
from services.router.admission.keys import add_key, revoke_key
from tests.support.redis import RedisServer

ROOT = Path(__file__).resolve().parents[4]


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def test_key_file_holds_only_hashes_and_key_maps_to_its_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    acme_key, _ = add_key(path, "acme", "acme-1", KeyLimits(requests_per_second=2, burst=3))
    globex_key, _ = add_key(path, "globex")
    text = path.read_text()
    assert acme_key not in text and globex_key not in text
    assert hash_key(acme_key) in text

    auth = Authenticator.from_file(path)
    acme = auth.authenticate(bearer(acme_key))
    assert acme == Principal("acme", "acme-1")
    assert acme.limits == KeyLimits(requests_per_second=2, burst=3)
    assert auth.authenticate(bearer(globex_key)).tenant == "globex"


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ([], "missing API key"),
        ([("authorization", "Bearer llmk_wrong")], "invalid API key"),
        ([("authorization", "Basic dXNlcjpwYXNz")], "expected 'Bearer <api key>'"),
        ([("authorization", "Bearer ")], "expected 'Bearer <api key>'"),
    ],
)
def test_missing_wrong_or_malformed_key_is_unauthenticated(
    tmp_path: Path, metadata: list[tuple[str, str]], message: str
) -> None:
    add_key(tmp_path / "keys.yaml", "acme")
    auth = Authenticator.from_file(tmp_path / "keys.yaml")
    with pytest.raises(errors.Unauthenticated, match=message):
        auth.authenticate(metadata)


def test_revocation_is_picked_up_from_the_changed_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    key, _ = add_key(path, "acme", "acme-1")
    auth = Authenticator.from_file(path)
    assert auth.authenticate(bearer(key)).key_id == "acme-1"
    revoke_key(path, "acme-1")
    json.loads(path.read_text())  # .json suffix keeps the file JSON
    with pytest.raises(errors.Unauthenticated, match="acme-1 has been revoked"):
        auth.authenticate(bearer(key))


@pytest.mark.parametrize(
    "broken",
    [
        "keys: [ {id: k, tenant: t\n",  # a YAML syntax error: an edit saved half-way
        "keys:\n  - just a string\n",  # an entry that is no mapping
        "keys:\n  - {tenant: t}\n",  # an entry with no id
    ],
)
def test_a_keys_file_broken_while_serving_keeps_the_keys_it_had(tmp_path: Path, broken: str) -> None:
    """An operator's typo must not lock every client out: the reload keeps the last good keys
    (a YAML error escaped it, and every request then failed)."""
    path = tmp_path / "keys.yaml"
    key, _ = add_key(path, "acme", "acme-1")
    auth = Authenticator.from_file(path)
    path.write_text(broken)
    assert auth.authenticate(bearer(key)).key_id == "acme-1"
    with pytest.raises(ValueError, match=r"keys\.yaml"):  # at start-up it is refused, by path
        Authenticator.from_file(path)


def test_open_mode_admits_everyone_as_the_default_tenant() -> None:
    auth = Authenticator.open("local")
    assert auth.authenticate([]) == Principal("local", "anonymous")
    assert auth.authenticate(bearer("anything")).tenant == "local"


def test_bad_keys_file_names_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [{"id": "k", "tenant": "t", "sha256": "abc"}]}))
    with pytest.raises(ValueError, match="sha256: must be 64 lowercase hex"):
        Authenticator.from_file(path)
    path.write_text(yaml.safe_dump({"keys": [{"id": "k", "tenant": "t", "sha256": "a" * 64, "rps": 1}]}))
    with pytest.raises(ValueError, match="unknown field"):
        Authenticator.from_file(path)
    with pytest.raises(ValueError, match="does not exist"):
        Authenticator.from_file(tmp_path / "missing.yaml")
    # A tenant the session service and the retriever cannot be told (gRPC metadata is ASCII): each
    # of its session turns was an INTERNAL blaming the client's session_id.
    for tenant in ("Société", "acme\tcorp", " acme", "t" * 257):
        path.write_text(yaml.safe_dump({"keys": [{"id": "k", "tenant": tenant, "sha256": "a" * 64}]}))
        with pytest.raises(ValueError, match="tenant: must be 1-256 printable ASCII"):
            Authenticator.from_file(path)
    path.write_text(
        yaml.safe_dump({"keys": [{"id": "k", "tenant": "Acme Corp (EU)", "sha256": hash_key("sk-eu")}]})
    )
    assert Authenticator.from_file(path).authenticate(bearer("sk-eu")).tenant == "Acme Corp (EU)"


def test_client_cannot_smuggle_internal_metadata() -> None:
    client = [
        ("x-llmmesh-tenant", "victim"),
        ("X-LLMMESH-USER", "admin"),
        ("authorization", "Bearer secret"),
        ("traceparent", "00-abc-def-01"),
    ]
    assert strip_internal(client) == [("traceparent", "00-abc-def-01")]
    assert downstream_metadata(Principal("acme", "acme-1")) == (
        ("x-llmmesh-tenant", "acme"),
        ("x-llmmesh-user", "acme-1"),
    )


async def test_keys_added_to_redis_are_accepted_after_refresh(redis_server: RedisServer) -> None:
    proc = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "services.router.admission.keys",
            "add",
            "--redis-url",
            redis_server.url,
            "--tenant",
            "acme",
            "--id",
            "r1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    key = proc.stdout.strip()
    assert key.startswith("llmk_")
    client = aioredis.from_url(redis_server.url, socket_timeout=5, socket_connect_timeout=2)
    try:
        stored = b"".join(await client.hvals("llm:apikeys"))
        assert key.encode() not in stored
        auth = Authenticator.from_redis(client)
        with pytest.raises(errors.Unauthenticated):
            auth.authenticate(bearer(key))
        await auth.refresh()
        assert auth.authenticate(bearer(key)) == Principal("acme", "r1")
        revoked = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "services.router.admission.keys",
                "revoke",
                "--redis-url",
                redis_server.url,
                "--id",
                "r1",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert revoked.returncode == 0, revoked.stderr
        await auth.refresh()
        with pytest.raises(errors.Unauthenticated, match="r1 has been revoked"):
            auth.authenticate(bearer(key))
    finally:
        await client.aclose()


def test_keys_cli_prints_the_key_once_and_revokes(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    cmd = [sys.executable, "-m", "services.router.admission.keys"]
    added = subprocess.run(
        [*cmd, "add", "--file", str(path), "--tenant", "acme", "--id", "cli-1", "--requests-per-second", "5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    assert Authenticator.from_file(path).authenticate(bearer(key)).limits.requests_per_second == 5
    dup = subprocess.run(
        [*cmd, "add", "--file", str(path), "--tenant", "acme", "--id", "cli-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dup.returncode == 2 and "already exists" in dup.stderr
    revoked = subprocess.run(
        [*cmd, "revoke", "--file", str(path), "--id", "cli-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert revoked.returncode == 0 and "revoked cli-1" in revoked.stdout
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        Authenticator.from_file(path).authenticate(bearer(key))
