"""Sizing and mesh set-up shared by the reliability tests: reduced in `make test`, full-size on demand.

`LLMMESH_RELIABILITY_SCALE=full` turns every sized test into its documented
full-size run (e.g. 1,000 streams instead of 200).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer

FULL = os.environ.get("LLMMESH_RELIABILITY_SCALE", "ci") == "full"


def sized(ci: int, full: int) -> int:
    """The CI size, or the full size when LLMMESH_RELIABILITY_SCALE=full."""
    return full if FULL else ci


@contextlib.contextmanager
def running(module: str, args: list[str], timeout: float = 300.0) -> Iterator[ServiceProcess]:
    """One service process, started (slow starts allowed) and always stopped, even on failure."""
    proc = ServiceProcess(module, args)
    try:
        yield proc.start(timeout=timeout)
    finally:
        proc.stop()


def synthetic_replica(*args: str) -> ServiceProcess:
    """A synthetic token source (a load-testing fake replica, no model) as a process."""
    return ServiceProcess("services.synthetic", ["--model-id", "synthetic", "--log-level", "WARNING", *args])


@dataclass
class Mesh:
    """Processes a test started, stopped in reverse order whatever happens."""

    redis: RedisServer | None = None
    session: ServiceProcess | None = None
    replicas: list[ServiceProcess] = field(default_factory=list)
    routers: list[ServiceProcess] = field(default_factory=list)
    #: Other services the routers call (e.g. a retriever).
    others: list[ServiceProcess] = field(default_factory=list)

    @property
    def router(self) -> ServiceProcess:
        return self.routers[-1]

    def start_router(
        self, *args: str, port: int | None = None, env: dict[str, str] | None = None
    ) -> ServiceProcess:
        argv = ["--replicas", ",".join(r.address for r in self.replicas), "--health-interval-s", "0.2"]
        argv += ["--probe-interval-s", "0", "--log-level", "WARNING"]
        if self.redis is not None:
            argv += ["--redis-url", self.redis.url]
        if self.session is not None:
            argv += ["--session-addr", self.session.address]
        if port is not None:
            argv += ["--port", str(port)]
        router = ServiceProcess("services.router", [*argv, *args], env=env)
        self.routers.append(router)
        return router.start(timeout=120)

    def stop(self) -> None:
        for p in [*reversed(self.routers), *self.replicas, *self.others, self.session]:
            if p is not None:
                with contextlib.suppress(Exception):
                    p.stop(timeout=15)
        if self.redis is not None:
            self.redis.kill()


@contextlib.contextmanager
def mesh(
    tmp: Path | None,
    replica_args: Sequence[Sequence[str]],
    *router_args: str,
    with_session: bool = False,
    router_env: dict[str, str] | None = None,
) -> Iterator[Mesh]:
    """Redis (+ session service) when ``tmp`` is given, synthetic replicas, one router."""
    m = Mesh()
    try:
        if tmp is not None:
            m.redis = RedisServer(tmp / "redis").start()
            if with_session:
                m.session = ServiceProcess(
                    "services.session", ["--redis-url", m.redis.url, "--log-level", "WARNING"]
                ).start(timeout=120)
        m.replicas = [synthetic_replica(*args) for args in replica_args]
        for r in m.replicas:
            r.start(timeout=120)
        m.start_router(*router_args, env=router_env)
        yield m
    finally:
        m.stop()


def list_replicas(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> list[router_pb2.ReplicaStatus]:
    with grpc.insecure_channel(address) as channel:
        reply = router_pb2_grpc.RouterStub(channel).ListReplicas(
            router_pb2.ListReplicasRequest(), metadata=metadata, timeout=5
        )
    return list(reply.replicas)


def chat(
    text: str, max_tokens: int = 8, session_id: str = "", seed: int | None = None
) -> router_pb2.ChatRequest:
    """A greedy turn that bypasses the response caches (every call reaches a replica)."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if seed is not None:
        sampling.seed = seed
    return router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content=text)],
        sampling=sampling,
        session_id=session_id,
        cache=router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS),
    )
