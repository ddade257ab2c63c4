"""Is a child ready yet: a free port to give it, its TCP port accepting, its gRPC health SERVING.

The launcher, the tests and the benches all wait on children they started
(services, Redis, Milvus Lite, the gateway); they wait through these functions,
so "ready" means the same everywhere. The waits return False rather than raise:
each caller words its own error (a launcher ``ChildFailed`` with the log path, a
test's ``TimeoutError`` with the output).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

#: Called with a connected socket: True when what listens there is ready (say, Redis answered PING).
Probe = Callable[[socket.socket], bool]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick); a child started on it may still race another."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_accepts(host: str, port: int, timeout: float = 0.5, probe: Probe | None = None) -> bool:
    """One try: something accepts a TCP connection on host:port (and ``probe`` is satisfied by it)."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout) as conn:
        return probe is None or probe(conn)
    return False


def redis_pong(conn: socket.socket) -> bool:
    """Redis answers PING: accepting connections is not enough while it still loads its AOF."""
    conn.sendall(b"PING\r\n")
    return conn.recv(16).startswith(b"+PONG")


def wait_port(
    host: str,
    port: int,
    deadline: float,
    alive: Callable[[], bool] | None = None,
    probe: Probe | None = None,
    poll_s: float = 0.1,
) -> bool:
    """Until host:port accepts (True), or ``alive()`` says the child exited, or ``deadline`` passed (False)."""
    while True:
        if alive is not None and not alive():
            return False
        if port_accepts(host, port, probe=probe):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def health_status(
    address: str,
    service: str = "",
    timeout: float = 2.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> int:
    """One gRPC health ``Check`` (a ``HealthCheckResponse`` status); raises ``grpc.RpcError`` if unanswered.

    A channel per check: a channel kept across a child's slow start would back off
    its reconnects and notice the child late.
    """
    channel = (
        grpc.secure_channel(address, credentials)
        if credentials is not None
        else grpc.insecure_channel(address)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return int(reply.status)


def is_serving(
    address: str, timeout: float = 2.0, credentials: grpc.ChannelCredentials | None = None
) -> bool:
    """One check: the health service answered SERVING (an error or any other status is False)."""
    try:
        return (
            health_status(address, timeout=timeout, credentials=credentials)
            == health_pb2.HealthCheckResponse.SERVING
        )
    except grpc.RpcError:
        return False


def wait_serving(
    address: str,
    deadline: float,
    alive: Callable[[], bool] | None = None,
    poll_s: float = 0.2,
    check_timeout: float = 2.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> bool:
    """Until gRPC health says SERVING (True), or ``alive()`` says the child exited, or ``deadline`` passed."""
    while True:
        if alive is not None and not alive():
            return False
        if is_serving(address, check_timeout, credentials):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


async def wait_serving_async(
    address: str,
    deadline: float,
    alive: Callable[[], bool] | None = None,
    poll_s: float = 0.2,
    check_timeout: float = 2.0,
) -> bool:
    """``wait_serving`` for an event loop (the benches wait on several children at once).

    The same loop on a worker thread, so there is one definition of "ready".
    """
    return await asyncio.to_thread(wait_serving, address, deadline, alive, poll_s, check_timeout)
