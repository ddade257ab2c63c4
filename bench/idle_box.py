"""What waking up costs on this machine: the price every relay hop pays when tokens come 10 ms apart.

A relay's added latency on an idle box is not its own code's warm speed: between
paced tokens every thread sleeps, and on a VM a vCPU that slept has cold caches
and must be woken by an interrupt from another vCPU. This script measures the
pieces a relayed token is made of, after the same idle gaps the paced benchmark
leaves (``bench/router.py`` paces tokens at 100/s):

- a thread hand-off (a byte over a pipe to another thread and back), with both
  threads on one vCPU and on two;
- the first call of a small C function (SHA-256 of 4 KiB) after the gap, against
  the same call warm;
- the acknowledgement of one message written by a grpc-python aio server (the
  wait between two writes on one call: one must complete before the next starts),
  on gRPC core's poller I/O as the router runs it.

    llm-mesh bench idle-box [--rounds 200] [--json bench/results/idle-box.json]
    python -m bench.idle_box  # the same

It changes nothing on the machine and pins only its own threads.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

GAPS_S = (0.0, 0.001, 0.01)


def _p50_us(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1000


def _sleep(gap_s: float) -> None:
    if gap_s:
        time.sleep(gap_s)


def handoff_us(gap_s: float, rounds: int, cpus: tuple[int, int] | None) -> float:
    """p50 round trip of one byte to another thread and back; ``cpus`` pins (caller, echo thread)."""
    to_echo, echo_in = os.pipe()
    echo_out, from_echo = os.pipe()

    def echo() -> None:
        while (b := os.read(to_echo, 1)) != b"q":
            os.write(from_echo, b)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    before = os.sched_getaffinity(0)
    try:
        if cpus is not None:
            os.sched_setaffinity(0, {cpus[0]})
            assert thread.native_id is not None
            os.sched_setaffinity(thread.native_id, {cpus[1]})
        samples = []
        for _ in range(rounds):
            _sleep(gap_s)
            started = time.perf_counter_ns()
            os.write(echo_in, b"x")
            os.read(echo_out, 1)
            samples.append(time.perf_counter_ns() - started)
        return _p50_us(samples)
    finally:
        os.write(echo_in, b"q")
        thread.join()
        os.sched_setaffinity(0, before)
        for fd in (to_echo, echo_in, echo_out, from_echo):
            os.close(fd)


def first_call_us(gap_s: float, rounds: int) -> float:
    """p50 of the first SHA-256 of 4 KiB after ``gap_s`` asleep."""
    data = b"x" * 4096
    for _ in range(100):
        hashlib.sha256(data).digest()
    samples = []
    for _ in range(rounds):
        _sleep(gap_s)
        started = time.perf_counter_ns()
        hashlib.sha256(data).digest()
        samples.append(time.perf_counter_ns() - started)
    return _p50_us(samples)


_CLIENT = """
import sys, grpc
call = grpc.insecure_channel(sys.argv[1]).unary_stream("/bench.IdleBox/Paced")
for _ in call(sys.argv[2].encode()):
    pass
"""


async def _write_acks_us(rounds: int) -> dict[float, float]:
    import grpc  # after grpc_io.configure: the router's I/O

    acks: dict[float, list[int]] = {gap: [] for gap in GAPS_S}

    async def paced(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        gap = float(request.decode())
        await context.write(b"first")  # the call's headers and first message
        for _ in range(rounds):
            if gap:
                await asyncio.sleep(gap)
            started = time.perf_counter_ns()
            await context.write(b"token" * 4)
            acks[gap].append(time.perf_counter_ns() - started)

    handler = grpc.method_handlers_generic_handler(
        "bench.IdleBox", {"Paced": grpc.unary_stream_rpc_method_handler(paced)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        for gap in GAPS_S:
            client = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _CLIENT, f"127.0.0.1:{port}", str(gap)
            )
            if await client.wait() != 0:
                raise RuntimeError(f"the client of the {gap * 1000:g} ms run failed")
    finally:
        await server.stop(None)
    return {gap: _p50_us(samples) for gap, samples in acks.items()}


def write_acks_us(rounds: int) -> dict[float, float]:
    """p50 of ``await context.write()`` in a grpc aio server, per gap between writes."""
    from services.router import grpc_io

    grpc_io.configure(os.environ)
    return asyncio.run(_write_acks_us(rounds))


def measure(rounds: int) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    rows: dict[str, dict[str, float]] = {}
    for gap in GAPS_S:
        row = {
            "handoff_one_vcpu_us": handoff_us(gap, rounds, (cpus[0], cpus[0])),
            "first_sha256_4k_us": first_call_us(gap, rounds),
        }
        if len(cpus) > 1:
            row["handoff_two_vcpus_us"] = handoff_us(gap, rounds, (cpus[0], cpus[1]))
        rows[f"{gap * 1000:g}ms"] = row
    for gap, ack in write_acks_us(rounds).items():
        rows[f"{gap * 1000:g}ms"]["grpc_aio_write_ack_us"] = ack
    return {
        "cpus": len(cpus),
        "rounds": rounds,
        "load_average_at_start": os.getloadavg()[0],
        "p50_us_after_gap": rows,
    }


def report(result: dict[str, Any]) -> str:
    columns = (
        ("handoff_one_vcpu_us", "thread hand-off, one vCPU"),
        ("handoff_two_vcpus_us", "thread hand-off, two vCPUs"),
        ("first_sha256_4k_us", "first SHA-256 of 4 KiB"),
        ("grpc_aio_write_ack_us", "grpc aio write acknowledged"),
    )
    rows = result["p50_us_after_gap"]
    lines = [
        f"p50 µs after each idle gap ({result['rounds']} rounds, {result['cpus']} vCPUs, "
        f"load {result['load_average_at_start']:.2f} at start)",
        "| idle gap | " + " | ".join(title for _, title in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for gap, row in rows.items():
        cells = [f"{row[key]:.0f}" if key in row else "–" for key, _ in columns]
        lines.append(f"| {gap} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=200, help="samples per figure")
    parser.add_argument("--json", type=Path, help="also write the figures here")


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        print("--rounds must be >= 1", file=sys.stderr)
        return 2
    result = measure(args.rounds)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
