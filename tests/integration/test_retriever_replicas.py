"""Two retriever replicas writing one corpus: per-document leases in Redis keep each document whole.

Each "replica" is its own ``Corpus`` (its own in-process locks) over one real Milvus
Lite store, as two pods over one Milvus server would be; only a lease both see in a
real Redis can keep them from writing one document at once.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from services.common.errors import Conflict, DependencyUnavailable
from services.gen.llmmesh.v1 import retriever_pb2_grpc
from services.retriever.chunking import ChunkingPolicy, TokenChunker
from services.retriever.config import RetrieverConfig
from services.retriever.corpus import Corpus, IngestResult, SearchQuery
from services.retriever.document_locks import RedisLocks
from tests.integration.test_retriever_service import ingest, rpc_error, search
from tests.integration.test_retriever_store import (
    DIM,
    BagOfWordsFakeEmbedder,
    ObservedStore,
    upload,
    versions_by_document,
    whitespace_token_spans,
)
from tests.support.document_router import DocumentRouter, document_router
from tests.support.processes import ROOT, ServiceProcess
from tests.support.redis import RedisServer
from tests.support.redis_cluster import RedisClusterServers


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObservedStore]:
    store = ObservedStore(
        str(tmp_path_factory.mktemp("milvus") / "milvus.db"), BagOfWordsFakeEmbedder.model_name, DIM
    )
    yield store
    store.close()


def replica(
    store: ObservedStore,
    server: RedisServer | RedisClusterServers,
    lease_s: float = 30.0,
    wait_s: float = 60.0,
) -> Corpus:
    chunker = TokenChunker(whitespace_token_spans, ChunkingPolicy(max_tokens=8, overlap_tokens=2))
    client: Any = (
        redis.RedisCluster.from_url(server.url, socket_timeout=2.0)
        if isinstance(server, RedisClusterServers)
        else redis.Redis.from_url(server.url, socket_timeout=2.0)
    )
    return Corpus(store, BagOfWordsFakeEmbedder(), chunker, locks=RedisLocks(client, lease_s, wait_s))


@pytest.fixture(params=["redis", "redis-cluster"])
def lock_server(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[RedisServer | RedisClusterServers]:
    """The Redis the replicas share: one server, or a 3-node Redis Cluster (`--redis-cluster`)."""
    server = RedisServer(tmp_path / "redis") if request.param == "redis" else RedisClusterServers(tmp_path)
    server.start()
    yield server
    server.stop()


def test_two_replicas_ingesting_one_document_at_once_take_turns(
    store: ObservedStore, lock_server: RedisServer | RedisClusterServers
) -> None:
    tenant = f"turns-{type(lock_server).__name__}"
    a, b = replica(store, lock_server), replica(store, lock_server)
    a.ingest(tenant, upload("plan", "harbour crane dock " * 10))
    steps: list[tuple[str, str]] = []
    b_done = threading.Event()
    b_result: list[IngestResult] = []

    def ingest_on_b() -> None:
        try:
            b_result.append(b.ingest(tenant, upload("plan", "harbour ferry pier " * 4)))
        finally:
            b_done.set()

    def observe(step: str) -> None:
        steps.append((threading.current_thread().name, step))
        if step == "write_chunks" and threading.current_thread().name == "MainThread":
            # Replica A is between writing its chunks and making them current: B starts now
            # and must wait for A's lease instead of writing the same version beside it.
            threading.Thread(target=ingest_on_b, name="replica-b").start()
            assert not b_done.wait(1.0), "replica B wrote while replica A held the document"

    store.observe = observe
    try:
        second = a.ingest(tenant, upload("plan", "harbour crane quay " * 7))
        assert b_done.wait(30.0)
    finally:
        store.observe = None

    third = b_result[0]
    assert (second.version, third.version) == (2, 3)
    # All of A's steps, then all of B's: never interleaved.
    assert [who for who, _ in steps] == ["MainThread"] * 4 + ["replica-b"] * 4
    hits = a.search(tenant, SearchQuery("harbour", top_k=50))
    assert versions_by_document(hits) == {"plan": {3}}
    assert len(hits) == third.chunks == store.count_chunks(tenant, "plan")
    assert {h.text.split()[1] for h in hits} == {"ferry"}


def test_a_writer_that_lost_its_lease_does_not_make_its_version_current(
    store: ObservedStore, redis_server: RedisServer
) -> None:
    tenant = "lost"
    a = replica(store, redis_server)
    first = a.ingest(tenant, upload("memo", "lantern wick oil " * 6))
    client = redis.Redis.from_url(redis_server.url)

    def drop_the_lease(step: str) -> None:
        if step == "write_chunks":  # as if Redis restarted empty while A was writing
            client.delete(RedisLocks.key(tenant, "memo"))

    store.observe = drop_the_lease
    try:
        with pytest.raises(Conflict, match="lost the write lease"):
            a.ingest(tenant, upload("memo", "lantern glass frame " * 9))
    finally:
        store.observe = None

    hits = a.search(tenant, SearchQuery("lantern", top_k=50))
    assert versions_by_document(hits) == {"memo": {1}}  # the old version, whole
    assert len(hits) == first.chunks
    again = a.ingest(tenant, upload("memo", "lantern glass frame " * 9))
    assert again.version == 2 and store.count_chunks(tenant, "memo") == again.chunks


def test_a_write_waiting_past_its_limit_is_aborted_and_the_holder_finishes(
    store: ObservedStore, redis_server: RedisServer
) -> None:
    tenant = "wait"
    holder = RedisLocks(redis.Redis.from_url(redis_server.url), lease_s=30.0, wait_s=0.0)
    b = replica(store, redis_server, wait_s=0.3)
    with (
        holder.hold(tenant, "log"),
        pytest.raises(Conflict, match="being written by another retriever replica"),
    ):
        b.ingest(tenant, upload("log", "signal flare smoke " * 5))
    assert b.ingest(tenant, upload("log", "signal flare smoke " * 5)).version == 1


def test_without_redis_writes_are_refused_and_search_still_answers(
    store: ObservedStore, redis_server: RedisServer
) -> None:
    tenant = "outage"
    a = replica(store, redis_server)
    a.ingest(tenant, upload("atlas", "compass bearing north " * 5))
    redis_server.kill()
    with pytest.raises(DependencyUnavailable, match="document locks"):
        a.ingest(tenant, upload("atlas", "compass bearing south " * 5))
    with pytest.raises(DependencyUnavailable, match="document locks"):
        a.delete(tenant, "atlas")
    hits = a.search(tenant, SearchQuery("compass", top_k=50))
    assert versions_by_document(hits) == {"atlas": {1}}


def test_the_lease_is_renewed_while_a_slow_write_runs(
    store: ObservedStore, redis_server: RedisServer
) -> None:
    tenant = "slow"
    a = replica(store, redis_server, lease_s=0.6)
    stalled = threading.Event()

    def stall(step: str) -> None:
        if step == "write_chunks":
            stalled.wait(2.0)  # three leases long: only renewal keeps it

    store.observe = stall
    try:
        result = a.ingest(tenant, upload("diary", "meadow clover bee " * 6))
    finally:
        store.observe = None
    assert result.version == 1
    assert versions_by_document(a.search(tenant, SearchQuery("meadow", top_k=50))) == {"diary": {1}}


def test_retriever_settings_refuse_a_cluster_without_a_url_and_a_lease_of_zero(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--redis-cluster needs --redis-url"):
        RetrieverConfig(milvus_uri=str(tmp_path / "m.db"), redis_cluster=True)
    with pytest.raises(ValueError, match="--document-lease-seconds"):
        RetrieverConfig(milvus_uri=str(tmp_path / "m.db"), redis_url="redis://x", document_lease_seconds=0)


def test_a_retriever_given_redis_takes_leases_and_refuses_writes_while_redis_is_down(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    service = ServiceProcess(
        "services.retriever",
        ["--milvus-uri", str(tmp_path / "milvus.db"), "--redis-url", redis_server.url, "--metrics-port", "0"],
    )
    with service, grpc.insecure_channel(service.address) as channel:
        stub = retriever_pb2_grpc.RetrieverStub(channel)
        first = ingest(stub, "guide", b"The ferry leaves the harbour at noon every day.")
        assert first.version == 1
        assert "document writes take leases in Redis (single)" in service.output()
        redis_server.kill()
        refused = rpc_error(ingest, stub, "guide", b"The ferry leaves at one o'clock.")
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert "document locks (Redis) unreachable" in refused.details()
        assert [c.document_version for c in search(stub, "When does the ferry leave?")] == [1]


def ingest_cli(
    router: DocumentRouter, path: Path, *flags: str, on_retry: Callable[[], None] = lambda: None
) -> tuple[int, str, str]:
    """`llm-mesh ingest PATH` as tenant acme, through ``router``; ``on_retry`` runs when it announces
    its first retry (while it waits to send again). Returns the exit status, stdout and stderr."""
    proc = subprocess.Popen(
        router.ingest_command(str(path), *flags, tenant="acme"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    stderr: list[str] = []
    for line in proc.stderr:
        stderr.append(line)
        if "retrying in" in line and sum("retrying in" in seen for seen in stderr) == 1:
            on_retry()
    out = proc.stdout.read()
    return proc.wait(timeout=120), out, "".join(stderr)


def test_ingest_cli_sends_a_document_again_while_another_replica_writes_it_or_redis_is_away(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    service = ServiceProcess(
        "services.retriever",
        ["--milvus-uri", str(tmp_path / "milvus.db"), "--redis-url", redis_server.url,
         "--document-lock-wait-seconds", "0.2", "--metrics-port", "0"],
    )  # fmt: skip
    notes = tmp_path / "notes.txt"
    notes.write_text("The ferry leaves the harbour at noon every day.")
    other_replica = redis.Redis.from_url(redis_server.url).lock(
        RedisLocks.key("acme", "notes.txt"), timeout=60
    )
    # The router passes the retriever's ABORTED and UNAVAILABLE on as they are; the command retries them.
    with service, document_router(service.address, tmp_path, ["acme"]) as router:
        # Another replica holds the document's lease: without retries the document is refused.
        assert other_replica.acquire(blocking=False)
        code, out, err = ingest_cli(router, notes, "--retries", "0")
        assert code == 1, out + err
        assert "skipped 1" in out and "ABORTED" in out and "being written by another retriever replica" in out

        # With retries it waits, and goes in once the other writer lets go.
        code, out, err = ingest_cli(router, notes, "--retry-seconds", "0.5", on_retry=other_replica.release)
        assert code == 0, out + err
        assert "notes.txt: ABORTED" in err
        assert "ingested 1 documents (0 unchanged)" in out and ", 1 retries" in out

        # Redis away: UNAVAILABLE, sent again once it is back (it then answers "unchanged").
        redis_server.kill()
        code, out, err = ingest_cli(router, notes, "--retry-seconds", "1.5", on_retry=redis_server.start)
        assert code == 0, out + err
        assert "notes.txt: UNAVAILABLE: document locks (Redis) unreachable" in err
        assert "ingested 0 documents (1 unchanged)" in out
