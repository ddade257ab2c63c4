"""The router on a Redis Cluster (``--redis-cluster``): tasks, Resume, rate limits and the exact
cache work across two routers when Redis is a 3-node cluster rather than one primary."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.gen.llmmesh.v1 import router_pb2
from services.router.admission.auth import KeyLimits
from services.router.admission.keys import add_key
from tests.integration.test_router_tasks import TASK_ENV, chat_request, read_then_drop, stub_for, wait_task
from tests.support.processes import ServiceProcess
from tests.support.redis_cluster import RedisClusterServers

ENDED = {router_pb2.TASK_STATE_SUCCEEDED, router_pb2.TASK_STATE_FAILED, router_pb2.TASK_STATE_CANCELLED}


class ClusterMesh:
    def __init__(
        self, cluster: RedisClusterServers, routers: list[ServiceProcess], key: str, limited_key: str
    ) -> None:
        self.cluster = cluster
        self.routers = routers
        self.auth = (("authorization", f"Bearer {key}"),)
        self.limited = (("authorization", f"Bearer {limited_key}"),)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterMesh]:
    tmp = Path(tmp_path_factory.mktemp("cluster"))
    cluster = RedisClusterServers(tmp / "redis").start()
    keys_file = tmp / "keys.yaml"
    key, _ = add_key(keys_file, "acme", "acme-main", KeyLimits())
    limited, _ = add_key(keys_file, "acme", "acme-two", KeyLimits(requests_per_second=0.01, burst=2))
    # A synthetic token source (no model): deterministic tokens, paced at 50 tokens/s.
    replica = ServiceProcess("services.synthetic", ["--tokens-per-second", "50"])
    routers: list[ServiceProcess] = []
    try:
        replica.start(timeout=120)
        for _ in range(2):
            args = ["--replicas", replica.address, "--redis-url", cluster.url, "--redis-cluster"]
            args += ["--api-keys-file", str(keys_file), "--metrics-port", "0"]
            routers.append(ServiceProcess("services.router", args, env=TASK_ENV).start(timeout=120))
        yield ClusterMesh(cluster, routers, key, limited)
    finally:
        for router in routers:
            router.stop()
        replica.stop()
        cluster.stop()


def test_a_task_submitted_to_one_router_is_read_from_the_other(mesh: ClusterMesh) -> None:
    request = chat_request("Tell me a story.", max_tokens=30)
    channel, stub = stub_for(mesh.routers[0])
    with channel:
        task = stub.SubmitTask(router_pb2.SubmitTaskRequest(request=request), timeout=10, metadata=mesh.auth)
        assert task.state == router_pb2.TASK_STATE_QUEUED
    channel, stub = stub_for(mesh.routers[1])
    with channel:
        done = wait_task(stub, task.task_id, ENDED, timeout=30, metadata=mesh.auth)
        assert done.state == router_pb2.TASK_STATE_SUCCEEDED, done.error_message
        direct = stub.Complete(request, timeout=30, metadata=mesh.auth)
        assert done.text == direct.text and done.end.usage.completion_tokens == 30


def test_resume_on_the_other_router_returns_the_missing_messages_once(mesh: ClusterMesh) -> None:
    request = chat_request("Count for me.", max_tokens=12, request_id="cluster-resume-1")
    received = read_then_drop(mesh.routers[0], request, 4, mesh.auth)
    channel, stub = stub_for(mesh.routers[1])
    with channel:
        resume = router_pb2.ResumeRequest(request_id="cluster-resume-1", last_seq=received[-1].seq)
        resumed = list(stub.Resume(resume, timeout=30, metadata=mesh.auth))
    seqs = [r.seq for r in received + resumed]
    assert seqs == list(range(1, len(seqs) + 1)) and resumed[-1].HasField("end")


def test_rate_limits_and_the_exact_cache_are_shared_by_both_routers(mesh: ClusterMesh) -> None:
    # The limited key may start two turns, in all: one on each router, then refused on either.
    request = chat_request("Name a colour.", max_tokens=4)
    request.cache.mode = router_pb2.CACHE_MODE_DEFAULT
    answers = []
    for router in mesh.routers:
        channel, stub = stub_for(router)
        with channel:
            answers.append(stub.Complete(request, timeout=30, metadata=mesh.limited))
    channel, stub = stub_for(mesh.routers[0])
    with channel:
        with pytest.raises(grpc.RpcError) as refused:
            stub.Complete(chat_request("Another?", 4), timeout=10, metadata=mesh.limited)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The second router answered the same deterministic request from the first one's cache entry.
    assert answers[0].end.cache_layer == router_pb2.CACHE_LAYER_UNSPECIFIED
    assert answers[1].end.cache_layer == router_pb2.CACHE_LAYER_EXACT
    assert answers[1].text == answers[0].text


def test_the_keys_tool_stores_and_lists_keys_in_the_cluster(mesh: ClusterMesh) -> None:
    where = ["--redis-url", mesh.cluster.url, "--redis-cluster"]
    tool = [sys.executable, "-m", "services.router.admission.keys"]
    added = subprocess.run(
        [*tool, "add", *where, "--tenant", "initech", "--id", "initech-1"], capture_output=True, text=True
    )
    assert added.returncode == 0, added.stderr
    assert added.stdout.startswith("llmk_")  # the key, shown once
    listed = subprocess.run([*tool, "list", *where], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    records = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["id"], r["tenant"]) for r in records] == [("initech-1", "initech")]
