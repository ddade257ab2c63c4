"""Slow readers that never drain their streams (reliability matrix row 6, second half).

Clients open long ChatStream calls through the router and then advertise an
HTTP/2 receive window of zero, so the router can send them nothing. Flow
control must push back all the way to the replica (the router pauses a
generation on the shared replica stream once its client is about a thousand tokens
behind): the router's memory stays bounded, it spends no CPU on them, and
healthy clients' p99 stays within 2x of the baseline. Replicas are
synthetic token sources (fake, unpaced: they produce as fast as they may).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import grpc
import h2.config
import h2.connection
import h2.settings
import psutil
import pytest

from services.gen.llmmesh.v1 import router_pb2, router_pb2_grpc
from tests.reliability.mesh_support import Mesh, chat, mesh, sized

# A wall-clock promise (healthy streams' p99 beside slow readers): make test runs it alone.
pytestmark = pytest.mark.serial

SLOW_READERS = sized(100, 500)
#: Each slow reader's answer: were it relayed into the router, 100 of them would be ~130 MiB.
ANSWER_TOKENS = 64_000
#: How long the router may take to pause every slow reader's generation (0.5 s for 100 here, 2.3 s
#: for 500; a CI machine once took over 3 s for 100).
SETTLE_LIMIT_S = 20.0
#: The quiet stretch measured once they are paused.
QUIET_S = 2.0


def settle(process: psutil.Process, quiet_cpu_s: float, window_s: float, limit_s: float) -> float | None:
    """Seconds until ``process`` used under ``quiet_cpu_s`` CPU in a ``window_s`` window; None past ``limit_s``."""
    started = time.monotonic()
    before = sum(process.cpu_times()[:2])
    while time.monotonic() - started < limit_s:
        time.sleep(window_s)
        now = sum(process.cpu_times()[:2])
        if now - before < quiet_cpu_s:
            return time.monotonic() - started
        before = now
    return None


@pytest.fixture(scope="module")
def unpaced_mesh() -> Iterator[Mesh]:
    # Answers longer than the synthetic replica's default 8,192-token context: it advertises 128k.
    replica = ("--tokens-per-chunk", "4", "--max-context-tokens", "131072")
    with mesh(None, [replica] * 2, "--max-in-flight", "4096") as m:
        yield m


def p99_latency(address: str, calls: int = 100) -> float:
    with grpc.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        samples = []
        for i in range(calls):
            started = time.perf_counter()
            stub.Complete(chat(f"healthy {i}", 4), timeout=10)
            samples.append(time.perf_counter() - started)
    samples.sort()
    return samples[int(0.99 * (len(samples) - 1))]


def open_never_reading_stream(port: int, request: router_pb2.ChatRequest) -> socket.socket:
    """A ChatStream whose client window is zero: the server may send headers, never data."""
    config = h2.config.H2Configuration(client_side=True)
    conn = h2.connection.H2Connection(config=config)
    conn.local_settings = h2.settings.Settings(
        client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
    )
    conn.initiate_connection()
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    stream_id = conn.get_next_available_stream_id()
    conn.send_headers(
        stream_id,
        [
            (":method", "POST"), (":scheme", "http"), (":path", "/llmmesh.v1.Router/ChatStream"),
            (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"), ("te", "trailers"),
        ],
    )  # fmt: skip
    payload = request.SerializeToString()
    conn.send_data(stream_id, struct.pack(">BI", 0, len(payload)) + payload, end_stream=True)
    sock.sendall(conn.data_to_send())
    return sock


def test_slow_readers_keep_router_memory_bounded_and_healthy_clients_fast(unpaced_mesh: Mesh) -> None:
    router = unpaced_mesh.router
    assert router.proc is not None and router.port is not None
    process = psutil.Process(router.proc.pid)
    p99_latency(router.address, 20)  # warm up
    baseline = p99_latency(router.address)
    rss_before = process.memory_info().rss

    readers: list[socket.socket] = []
    try:
        for i in range(SLOW_READERS):
            readers.append(open_never_reading_stream(router.port, chat(f"never read {i}", ANSWER_TOKENS)))
        # Each slow reader first gets what its stream's buffers take and ~PAUSE_AFTER_TOKENS more, then
        # its generation is paused on the replica. How long that takes varies with the machine (the
        # unpaced replicas' overshoot before the pause lands); once it is done, the router must go
        # quiet. Relaying the 3,200,000 tokens instead keeps a core busy for many seconds.
        settled_after = settle(process, quiet_cpu_s=0.1, window_s=0.5, limit_s=SETTLE_LIMIT_S)
        assert settled_after is not None, (
            f"the router never went quiet: it relays the slow readers' answers ({SETTLE_LIMIT_S:.0f} s)"
        )
        cpu_settled = sum(process.cpu_times()[:2])
        rss_settled = process.memory_info().rss
        time.sleep(QUIET_S)  # unpaced replicas would produce tokens all along without back-pressure
        router_cpu = sum(process.cpu_times()[:2]) - cpu_settled
        # The better of two rounds: a relaying router is slow in both, while one scheduler stall of
        # this 2-vCPU VM moves a 100-call p99 alone (once 16.5 ms against a 4.0 ms baseline, then
        # under 8 ms on three reruns).
        under_load = min(p99_latency(router.address), p99_latency(router.address))
        rss_after = process.memory_info().rss
        in_flight = sum(
            r.in_flight
            for r in router_pb2_grpc.RouterStub(grpc.insecure_channel(router.address))
            .ListReplicas(router_pb2.ListReplicasRequest(), timeout=5)
            .replicas
        )
    finally:
        for s in readers:
            s.close()

    print(
        f"row 6: {SLOW_READERS} slow readers, quiet after {settled_after:.1f} s, router RSS "
        f"+{(rss_after - rss_before) / 2**20:.1f} MiB, healthy p99 {baseline * 1000:.1f} -> "
        f"{under_load * 1000:.1f} ms, router CPU {router_cpu:.2f} s in the next {QUIET_S:.0f} s"
    )
    assert router_cpu < 0.3, (
        f"the router spent {router_cpu:.2f} CPU-s in {QUIET_S:.0f} s on clients that read nothing"
    )
    # Paused, the readers hold what they hold: the router does not grow while they sit there.
    grown = rss_after - rss_settled
    assert grown < 8 * 2**20, f"router memory grew by {grown / 2**20:.1f} MiB while the readers sat paused"
    assert in_flight >= SLOW_READERS // 2, "the slow readers' streams never reached a replica"
    # 120-180 KiB a reader held paused (its last ~1,000 tokens, the streams' buffers); 1 MiB is the
    # limit. Relaying the answers into memory instead grew the router by 64 MiB for 100 readers at
    # 32,000 tokens (docs/reliability.md, finding 7), ~1.3 MiB a reader at 64,000, and never goes quiet.
    limit = SLOW_READERS * 1024 * 1024
    assert rss_after - rss_before < limit, f"router memory grew by more than {limit / 2**20:.0f} MiB"
    assert under_load <= max(2 * baseline, baseline + 0.01), (baseline, under_load)
