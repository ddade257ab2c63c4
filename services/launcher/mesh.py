"""The local mesh's plan (which processes, which flags) and its lifecycle (start in order, stop in reverse)."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.common.settings import (
    INFERENCE_PORT,
    RETRIEVER_PORT,
    ROUTER_HTTP_PORT,
    ROUTER_PORT,
    SESSION_PORT,
)
from services.inference import memory_budget
from services.launcher.children import ChildFailed, ChildProcess
from services.launcher.readiness import free_port
from services.launcher.redis_local import redis_command

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
GATEWAY_BINARY = ROOT / "deploy" / "gateway" / "bin" / "llm-mesh-gateway"

# The services' own default ports (services/common/settings.py); replicas step by 10 from
# the inference port so each can add neighbours later.
INFERENCE_BASE_PORT = INFERENCE_PORT
REDIS_PORT = 6379
GATEWAY_LISTEN = "127.0.0.1:8080"
# Where everything behind the router listens, whatever --host says: Redis, session, retriever
# and replicas trust their callers (the tenant is plain metadata the router sets after checking
# the API key), so only the router, on this machine, may reach them.
INTERNAL_HOST = "127.0.0.1"
# What one machine's Redis, session, retriever (embedding model, Milvus Lite) and router
# need beside the replicas: ≈ 0.8 GiB resident idle (measured 2026-11-30), with room to
# grow under load. The replicas share the rest.
SHARED_SERVICES_MIB = 2048


@dataclass(frozen=True)
class MeshConfig:
    """What `llm-mesh up` runs. ``router_port == 0`` puts every service on a free port (tests)."""

    data_dir: Path
    model: Path = DEFAULT_MODEL
    replicas: int = 1
    #: Where the router listens; the services behind it always listen on INTERNAL_HOST.
    host: str = "127.0.0.1"
    router_port: int = ROUTER_PORT
    #: The router's OpenAI HTTP port on ``host``; None = no HTTP front.
    http_port: int | None = ROUTER_HTTP_PORT
    redis_url: str | None = None
    milvus_uri: str | None = None
    gateway: bool = False
    #: The router's API keys (``llm-mesh keys add`` writes them); None = open, one tenant.
    api_keys_file: Path | None = None
    device: str = "auto"
    # The whole mesh's memory (None: the cgroup's limit, else the machine's RAM).
    memory_limit_mib: int | None = None
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 45.0
    python: str = sys.executable
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if not 0 <= self.router_port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.router_port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be in 0..65535, got {self.http_port}")
        if self.api_keys_file is not None and not self.api_keys_file.is_file():
            raise ValueError(
                f"--api-keys-file {self.api_keys_file}: no such file (create one with "
                "`llm-mesh keys add --tenant NAME`)"
            )
        if self.memory_limit_mib is not None and self.memory_limit_mib < 1:
            raise ValueError(f"--memory-limit-mib must be >= 1, got {self.memory_limit_mib}")

    @property
    def ephemeral(self) -> bool:
        return self.router_port == 0

    def port(self, fixed: int) -> int:
        return 0 if self.ephemeral else fixed

    def inference_port(self, index: int) -> int:
        return self.port(INFERENCE_BASE_PORT + 10 * index)

    def internal_ports(self) -> list[tuple[str, int]]:
        """The fixed ports the services behind the router take on INTERNAL_HOST (none with
        ``--port 0``); Redis finds a free one itself when 6379 is taken."""
        if self.ephemeral:
            return []
        ports = [("session service", SESSION_PORT), ("retriever", RETRIEVER_PORT)]
        return ports + [(f"inference replica {i}", self.inference_port(i)) for i in range(self.replicas)]

    def memory_plan(self) -> tuple[memory_budget.MemoryLimit, int]:
        """The mesh's memory and each replica's share of it (MiB).

        Every replica would otherwise plan its KV cache and slab against the whole
        machine, and N of them on one box would be OOM-killed once busy enough to
        touch their caches (which are mapped lazily). Each gets an even share of what
        the other services leave, passed as its ``--memory-limit-mib``; a share too
        small for one context makes that replica refuse to start, saying so.
        Raises ValueError when nothing is left for the replicas at all.
        """
        limit = memory_budget.memory_limit(self.memory_limit_mib)
        share = ((limit.bytes >> 20) - SHARED_SERVICES_MIB) // self.replicas
        if share < 1:
            raise ValueError(
                f"{limit.bytes >> 20} MiB of memory ({limit.source}) leaves nothing for "
                f"{self.replicas} inference replica(s) after {SHARED_SERVICES_MIB} MiB for Redis, "
                "session, retriever and router"
            )
        return limit, share

    def replica_command(self, index: int, memory_mib: int) -> list[str]:
        return self.service_command(
            "services.inference",
            self.inference_port(index),
            "--model",
            str(self.model),
            "--device",
            self.device,
            "--memory-limit-mib",
            str(memory_mib),
        )

    def session_command(self) -> list[str]:
        """Its Redis comes by environment (``redis_env``), as the router's does."""
        return self.service_command("services.session", self.port(SESSION_PORT))

    def retriever_command(self) -> list[str]:
        """Its Milvus comes by environment (``milvus_env``): a server's URI may carry a password."""
        return self.service_command("services.retriever", self.port(RETRIEVER_PORT))

    def router_command(self, replicas: list[str], session: str, retriever: str) -> list[str]:
        """The one service on ``--host``: every client, and every API-key check, comes through it."""
        return self.service_command(
            "services.router",
            self.router_port,
            "--replicas",
            ",".join(replicas),
            "--session-addr",
            session,
            "--retriever-addr",
            retriever,
            # The replicas' model: the router hashes prompts with its tokenizer (prefix placement).
            "--tokenizer",
            str(self.model),
            *(["--no-http"] if self.http_port is None else ["--http-port", str(self.port(self.http_port))]),
            *(["--api-keys-file", str(self.api_keys_file)] if self.api_keys_file is not None else []),
            host=self.host,
        )

    @property
    def milvus(self) -> str:
        return self.milvus_uri or str(self.data_dir / "milvus.db")

    def service_command(self, module: str, port: int, *flags: str, host: str = INTERNAL_HOST) -> list[str]:
        """A service's command line, listening on loopback unless it is the router (``host``)."""
        # Metrics on a free port: the ready block and the lock file say which.
        return [
            self.python,
            "-m",
            module,
            "--host",
            host,
            "--port",
            str(port),
            "--metrics-port",
            "0",
            *flags,
        ]

    @staticmethod
    def redis_env(redis_url: str) -> dict[str, str]:
        """Redis for the session service and the router, as ``--redis-url``'s environment default:
        a password in the URL given on their command line was shown to every local user by
        ``ps``."""
        return {"LLMMESH_REDIS_URL": redis_url}

    def milvus_env(self) -> dict[str, str]:
        """Milvus for the retriever, as ``--milvus-uri``'s environment default (see ``redis_env``)."""
        return {"LLMMESH_MILVUS_URI": self.milvus}

    def child_env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **self.extra_env}
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env


def port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class LocalMesh:
    """Starts Redis, session, retriever, the replicas, the router (and the gateway) and stops them in reverse.

    Children are recorded the moment they are spawned, so a failure or a signal
    halfway through start-up still stops exactly what was started.
    """

    def __init__(self, config: MeshConfig, say: Callable[[str], None] = print) -> None:
        self.config = config
        self.say = say
        self.started: list[ChildProcess] = []
        self.redis_url = config.redis_url
        self.redis: ChildProcess | None = None
        self.session: ChildProcess | None = None
        self.retriever: ChildProcess | None = None
        self.replicas: list[ChildProcess] = []
        self.router: ChildProcess | None = None
        self.gateway: ChildProcess | None = None

    def _spawn(self, name: str, command: list[str], env: dict[str, str] | None = None) -> ChildProcess:
        log = self.config.data_dir / "logs" / f"{name}.log"
        child = ChildProcess(name, command, log, {**self.config.child_env(), **(env or {})}).start()
        self.started.append(child)
        return child

    def start(self) -> None:
        cfg = self.config
        deadline = time.monotonic() + cfg.startup_timeout_s
        if self.redis_url is None:
            self._start_redis(deadline)
        assert self.redis_url is not None
        redis_env = cfg.redis_env(self.redis_url)
        self.session = self._spawn("session", cfg.session_command(), redis_env)
        self.retriever = self._spawn("retriever", cfg.retriever_command(), cfg.milvus_env())
        limit, share = cfg.memory_plan()
        self.say(
            f"  memory: {limit.bytes >> 20} MiB ({limit.source}), {SHARED_SERVICES_MIB} MiB kept for "
            f"Redis, session, retriever and router, {share} MiB for each inference replica"
        )
        for i in range(cfg.replicas):
            self.replicas.append(self._spawn(f"inference-{i}", cfg.replica_command(i, share)))
        # Everything the router depends on loads in parallel; the router starts once they all serve.
        for child in [self.session, self.retriever, *self.replicas]:
            self.say(f"  waiting for {child.name} …")
            child.wait_serving(deadline)
        self.router = self._spawn(
            "router",
            cfg.router_command(
                [r.address for r in self.replicas], self.session.address, self.retriever.address
            ),
            redis_env,
        )
        self.router.wait_serving(deadline)
        if cfg.gateway:
            self._start_gateway(deadline)

    def _start_redis(self, deadline: float) -> None:
        cfg = self.config
        port = REDIS_PORT
        if cfg.ephemeral or port_taken(INTERNAL_HOST, port):
            port = free_port(INTERNAL_HOST)
        redis_dir = cfg.data_dir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        self.redis = self._spawn("redis", redis_command(redis_dir, INTERNAL_HOST, port))
        self.redis.wait_port(INTERNAL_HOST, port, deadline)
        self.redis_url = f"redis://{INTERNAL_HOST}:{port}/0"

    def _start_gateway(self, deadline: float) -> None:
        if not os.access(GATEWAY_BINARY, os.X_OK):
            self.say(
                f"  gateway not built ({GATEWAY_BINARY} missing): run `make gateway`; continuing without it"
            )
            return
        assert self.router is not None
        host, fixed = GATEWAY_LISTEN.rsplit(":", 1)
        port = free_port(host) if self.config.ephemeral else int(fixed)
        listen = f"{host}:{port}"
        self.gateway = self._spawn(
            "gateway", [str(GATEWAY_BINARY), "--listen", listen, "--upstream", self.router.address]
        )
        self.gateway.wait_port(host, port, deadline)

    def pids(self) -> dict[str, int]:
        """name -> pid of every child now running (a restart changes it), for the lock file."""
        return {c.name: c.pid for c in self.started if c.pid is not None and c.alive()}

    def stop(self) -> None:
        """Reverse start order; replicas of one tier drain together. Each tier gets the stop timeout."""
        tiers: list[list[ChildProcess]] = []
        for name in ("gateway", "router", "inference", "retriever", "session", "redis"):
            tier = [c for c in self.started if c.name == name or c.name.startswith(f"{name}-")]
            if tier:
                tiers.append(tier)
        for tier in tiers:
            for child in tier:
                child.terminate()
            for child in tier:
                child.wait_exit(self.config.stop_timeout_s)
        self.started.clear()

    def endpoints(self) -> dict[str, str]:
        """name -> host:port of every gRPC service started, for the ready block and the lock file."""
        found: dict[str, str] = {}
        for child in self.started:
            if child.port is not None:
                found[child.name] = child.address
        return found

    def metrics_endpoints(self) -> dict[str, str]:
        return {c.name: f"{c.host}:{c.metrics_port}" for c in self.started if c.metrics_port is not None}


__all__ = ["ChildFailed", "LocalMesh", "MeshConfig"]
