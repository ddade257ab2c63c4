"""Router overhead: streams through the router vs straight to a replica, relay throughput, 1,000 streams.

    python -m bench.router                      # synthetic token source + real engine
    python -m bench.router --skip-engine        # synthetic token source only

Replicas are the synthetic token source (a fake replica for load tests, no
model) and, separately, the real engine. Figures: p50/p99 latency the router
adds per stream (end to end and to the first token), relayed tokens per second
(wall clock and per CPU-second of the router process), and the success rate of
1,000 concurrent streams through one router to two replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import psutil

from bench.timings import percentile
from services.gen.llmmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

if TYPE_CHECKING:
    from services.gen.llmmesh.v1.inference_pb2_grpc import InferenceAsyncStub
    from services.gen.llmmesh.v1.router_pb2_grpc import RouterAsyncStub

ROOT = Path(__file__).resolve().parents[1]
LISTEN_RE = re.compile(r"llm-mesh \S+ listening on (\S+):(\d+)")


class Service:
    """A service process on an ephemeral port (the bootstrap prints where it listens)."""

    def __init__(self, module: str, args: list[str]) -> None:
        self.module = module
        self.args = args
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self._ready = threading.Event()
        self.lines: list[str] = []

    def start(self, timeout_s: float = 300.0) -> Service:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, "--port", "0", "--log-level", "WARNING", *self.args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"{self.module} did not start:\n" + "\n".join(self.lines[-40:]))
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if m := LISTEN_RE.search(line):
                self.address = f"127.0.0.1:{m.group(2)}"
                self._ready.set()

    async def wait_serving(self, timeout_s: float = 300.0) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.2)
        raise TimeoutError(f"{self.module} not serving after {timeout_s}s")

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        times = psutil.Process(self.proc.pid).cpu_times()
        return float(times.user + times.system)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@dataclass
class StreamTiming:
    """One stream as the client saw it."""

    ttft_s: float
    total_s: float
    tokens: int


@dataclass
class Overhead:
    """Router vs direct, same requests, interleaved."""

    source: str
    streams: int
    tokens_per_stream: int
    direct_p50_ms: float
    direct_p99_ms: float
    routed_p50_ms: float
    routed_p99_ms: float
    added_p50_ms: float
    added_p99_ms: float
    added_ttft_p50_ms: float
    added_ttft_p99_ms: float


@dataclass
class Throughput:
    """Relayed tokens with many streams in flight."""

    concurrency: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    router_cpu_s: float
    tokens_per_router_cpu_s: float


@dataclass
class Concurrency:
    """Many simultaneous streams through one router."""

    streams: int
    succeeded: int
    failed: int
    wall_s: float
    errors: dict[str, int] = field(default_factory=dict)


def turn(text: str, max_tokens: int) -> router_pb2.ChatRequest:
    return router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content=text)],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        cache=router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS),
    )


async def routed_stream(stub: RouterAsyncStub, request: router_pb2.ChatRequest) -> StreamTiming:
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    call = stub.ChatStream(request, timeout=600)
    async for response in call:
        if response.HasField("delta"):
            if first is None:
                first = time.perf_counter()
            tokens += len(response.delta.token_ids)
    end = time.perf_counter()
    return StreamTiming((first or end) - started, end - started, tokens)


async def direct_stream(stub: InferenceAsyncStub, request: router_pb2.ChatRequest) -> StreamTiming:
    start = inference_pb2.GenerateStart(messages=request.messages, sampling=request.sampling)
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    call = stub.Generate(timeout=600)  # type: ignore[call-arg]
    await call.write(inference_pb2.GenerateRequest(start=start))
    async for response in call:
        if response.HasField("chunk"):
            if first is None:
                first = time.perf_counter()
            tokens += len(response.chunk.token_ids)
        elif response.HasField("finished"):
            break
    end = time.perf_counter()
    return StreamTiming((first or end) - started, end - started, tokens)


async def measure_overhead(
    source: str, router: Service, replica: Service, streams: int, tokens: int, warmup: int = 5
) -> Overhead:
    """Pairs of (direct, routed) streams of the same request, one after another."""
    direct: list[StreamTiming] = []
    routed: list[StreamTiming] = []
    async with (
        grpc.aio.insecure_channel(router.address) as rch,
        grpc.aio.insecure_channel(replica.address) as dch,
    ):
        rstub: RouterAsyncStub = router_pb2_grpc.RouterStub(rch)  # type: ignore[assignment]
        dstub: InferenceAsyncStub = inference_pb2_grpc.InferenceStub(dch)  # type: ignore[assignment]
        for i in range(warmup + streams):
            request = turn(f"benchmark prompt {i % 7}", tokens)
            d = await direct_stream(dstub, request)
            r = await routed_stream(rstub, request)
            if i >= warmup:
                direct.append(d)
                routed.append(r)

    def ms(values: list[float], q: float) -> float:
        return percentile(values, q) * 1000

    d_total, r_total = [t.total_s for t in direct], [t.total_s for t in routed]
    d_ttft, r_ttft = [t.ttft_s for t in direct], [t.ttft_s for t in routed]
    return Overhead(
        source=source,
        streams=streams,
        tokens_per_stream=tokens,
        direct_p50_ms=ms(d_total, 50),
        direct_p99_ms=ms(d_total, 99),
        routed_p50_ms=ms(r_total, 50),
        routed_p99_ms=ms(r_total, 99),
        added_p50_ms=ms(r_total, 50) - ms(d_total, 50),
        added_p99_ms=ms(r_total, 99) - ms(d_total, 99),
        added_ttft_p50_ms=ms(r_ttft, 50) - ms(d_ttft, 50),
        added_ttft_p99_ms=ms(r_ttft, 99) - ms(d_ttft, 99),
    )


async def measure_throughput(router: Service, concurrency: int, tokens: int, rounds: int) -> Throughput:
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub: RouterAsyncStub = router_pb2_grpc.RouterStub(channel)  # type: ignore[assignment]
        await routed_stream(stub, turn("warm up", 8))
        cpu_before = router.cpu_seconds()
        started = time.perf_counter()
        total = 0
        for r in range(rounds):
            results = await asyncio.gather(
                *(routed_stream(stub, turn(f"throughput {r}-{i}", tokens)) for i in range(concurrency))
            )
            total += sum(t.tokens for t in results)
        wall = time.perf_counter() - started
        cpu = router.cpu_seconds() - cpu_before
    return Throughput(concurrency, total, wall, total / wall, cpu, total / cpu if cpu else 0.0)


async def measure_concurrency(router: Service, streams: int, tokens: int) -> Concurrency:
    # Several client channels: one HTTP/2 connection caps concurrent streams (often at 100).
    channels = [grpc.aio.insecure_channel(router.address) for _ in range(max(1, streams // 90))]
    stubs: list[RouterAsyncStub] = [router_pb2_grpc.RouterStub(c) for c in channels]  # type: ignore[misc]
    errors: dict[str, int] = {}

    async def one(i: int) -> bool:
        try:
            timing = await routed_stream(stubs[i % len(stubs)], turn(f"concurrent {i}", tokens))
            return timing.tokens == tokens
        except grpc.aio.AioRpcError as exc:
            errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
            return False

    started = time.perf_counter()
    ok = await asyncio.gather(*(one(i) for i in range(streams)))
    wall = time.perf_counter() - started
    for c in channels:
        await c.close(None)
    succeeded = sum(ok)
    return Concurrency(streams, succeeded, streams - succeeded, wall, errors)


async def run_synthetic(args: argparse.Namespace) -> dict[str, Any]:
    """Two routers, each over two synthetic token sources: unpaced (the router is the bottleneck) and paced."""
    unpaced = [Service("services.router.synthetic_replica", []) for _ in range(2)]
    pace = ["--tokens-per-second", str(args.paced_tokens_per_second)]
    paced = [Service("services.router.synthetic_replica", pace) for _ in range(2)]
    routers: list[Service] = []
    try:
        for s in [*unpaced, *paced]:
            s.start()
        for group in (unpaced, paced):
            flags = [
                "--replicas",
                ",".join(r.address for r in group),
                "--policy",
                "least",
                "--max-in-flight",
                "8192",
            ]
            routers.append(Service("services.router", flags).start())
        for s in [*unpaced, *paced, *routers]:
            await s.wait_serving()
        fast_router, paced_router = routers
        overhead = await measure_overhead(
            "synthetic-unpaced", fast_router, unpaced[0], args.streams, args.tokens
        )
        paced_overhead = await measure_overhead(
            f"synthetic-{args.paced_tokens_per_second:g}-tok/s",
            paced_router,
            paced[0],
            args.paced_streams,
            args.paced_tokens,
        )
        throughput = await measure_throughput(
            fast_router, args.concurrency, args.throughput_tokens, args.rounds
        )
        concurrent = await measure_concurrency(paced_router, args.concurrent_streams, args.concurrent_tokens)
    finally:
        for s in [*routers, *unpaced, *paced]:
            s.stop()
    results = {
        "overhead_unpaced": asdict(overhead),
        "overhead_paced": asdict(paced_overhead),
        "throughput": asdict(throughput),
        "concurrency": asdict(concurrent),
    }
    # Router cost is per gRPC message, not per token: the same run with several tokens per chunk.
    for size in args.multi_token_chunks:
        results[f"throughput_{size}_tokens_per_chunk"] = asdict(await chunked_throughput(args, size))
    return results


async def chunked_throughput(args: argparse.Namespace, tokens_per_chunk: int) -> Throughput:
    replicas = [
        Service("services.router.synthetic_replica", ["--tokens-per-chunk", str(tokens_per_chunk)])
        for _ in range(2)
    ]
    router: Service | None = None
    try:
        for r in replicas:
            r.start()
        flags = ["--replicas", ",".join(r.address for r in replicas), "--policy", "least"]
        router = Service("services.router", flags).start()
        for service in [*replicas, router]:
            await service.wait_serving()
        return await measure_throughput(router, args.concurrency, args.throughput_tokens, args.rounds)
    finally:
        for started in [router, *replicas]:
            if started is not None:
                started.stop()


async def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    replica = Service("services.inference", ["--model", args.model, "--device", args.device]).start()
    router: Service | None = None
    try:
        await replica.wait_serving()
        router = Service("services.router", ["--replicas", replica.address]).start()
        await router.wait_serving()
        overhead = await measure_overhead(
            "engine", router, replica, args.engine_streams, args.engine_tokens, 2
        )
    finally:
        for s in [router, replica]:
            if s is not None:
                s.stop()
    return {"overhead": asdict(overhead)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, default=300, help="paired streams for the overhead figures")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per overhead stream")
    parser.add_argument("--concurrency", type=int, default=64, help="streams in flight for throughput")
    parser.add_argument("--throughput-tokens", type=int, default=512, help="tokens per throughput stream")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds")
    parser.add_argument("--concurrent-streams", type=int, default=1000, help="streams started at once")
    parser.add_argument("--concurrent-tokens", type=int, default=32, help="tokens per concurrent stream")
    parser.add_argument(
        "--paced-tokens-per-second", type=float, default=100.0, help="pace of the paced synthetic sources"
    )
    parser.add_argument("--paced-streams", type=int, default=60, help="paired streams on paced sources")
    parser.add_argument("--paced-tokens", type=int, default=32, help="tokens per paced overhead stream")
    parser.add_argument(
        "--multi-token-chunks",
        type=lambda text: [int(x) for x in text.split(",") if x],
        default=[4],
        help="also measure throughput with this many tokens per replica message (comma list; '' = skip)",
    )
    parser.add_argument("--skip-engine", action="store_true", help="synthetic token source only")
    parser.add_argument(
        "--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"), help="real engine model"
    )
    parser.add_argument("--device", default="auto", help="real engine device")
    parser.add_argument("--engine-streams", type=int, default=20, help="paired streams on the real engine")
    parser.add_argument("--engine-tokens", type=int, default=16, help="tokens per real-engine stream")
    parser.add_argument("--json", default=None, help="write the figures here as JSON")


def run(args: argparse.Namespace) -> int:
    results: dict[str, Any] = {"machine": f"{os.cpu_count()} CPUs, {sys.platform}", "started_at": time.time()}
    results["synthetic"] = asyncio.run(run_synthetic(args))
    if not args.skip_engine:
        results["engine"] = asyncio.run(run_engine(args))
    print(json.dumps(results, indent=2))
    syn = results["synthetic"]
    for key in ("overhead_unpaced", "overhead_paced"):
        o = syn[key]
        print(
            f"{o['source']}: {o['tokens_per_stream']} tokens/stream, router adds p50 {o['added_p50_ms']:.3f} ms,"
            f" p99 {o['added_p99_ms']:.3f} ms per stream (TTFT +{o['added_ttft_p50_ms']:.3f} ms p50)"
        )
    t, c = syn["throughput"], syn["concurrency"]
    print(
        f"relayed {t['tokens_per_s']:.0f} tok/s wall, {t['tokens_per_router_cpu_s']:.0f} tok per router CPU-s;"
        f" {c['succeeded']}/{c['streams']} concurrent streams ok in {c['wall_s']:.1f} s"
    )
    for size in args.multi_token_chunks:
        m = syn[f"throughput_{size}_tokens_per_chunk"]
        print(
            f"{size} tokens/chunk: relayed {m['tokens_per_s']:.0f} tok/s wall,"
            f" {m['tokens_per_router_cpu_s']:.0f} tok per router CPU-s"
        )
    if "engine" in results:
        e = results["engine"]["overhead"]
        print(
            f"engine: router adds p50 {e['added_p50_ms']:.3f} ms, p99 {e['added_p99_ms']:.3f} ms per stream"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    ok = c["succeeded"] == c["streams"]
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
