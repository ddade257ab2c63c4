"""`python -m bench.load`: many concurrent clients against the router; success, throughput, latency, plots.

Drives ``Router.ChatStream`` with N clients, closed-loop (each client sends its
next turn when the last one ended) or open-loop (arrivals at a fixed rate, not
waiting for answers), per concurrency level, and reports success rate,
throughput, TTFT / inter-token / end-to-end percentiles. It can start its own
mesh (synthetic token sources, named as such, or real engine replicas), and
run a failover phase that kills one replica with SIGKILL mid-load and plots
tokens/s over time with the kill and the ejection marked. The reliability
tests reuse ``stream_once`` and ``run_closed_loop`` as their client.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from bench.router import Service
from bench.timings import percentile
from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

if TYPE_CHECKING:
    from services.gen.llmmesh.v1.router_pb2_grpc import RouterAsyncStub

# Many streams share one HTTP/2 connection badly on a busy loop; spread them over a few.
CLIENT_CHANNELS = 8
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.enable_retries", 0),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
]
Metadata = tuple[tuple[str, str], ...]
RequestFactory = Callable[[int], router_pb2.ChatRequest]


@dataclass
class StreamOutcome:
    """One ChatStream call as the client saw it."""

    code: str
    started: float
    latency_s: float
    ttft_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    replica: str = ""
    failovers: int = 0
    retries: int = 0
    finish_reason: int = 0
    degraded: bool = False
    details: str = ""
    #: RetryInfo's delay on a RESOURCE_EXHAUSTED refusal, when the server sent one.
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    @property
    def contiguous(self) -> bool:
        """Token positions 0, 1, 2, … with no gap and no duplicate."""
        return self.positions == list(range(len(self.positions)))

    @property
    def inter_token_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]


class ClientPool:
    """A few channels to one router, handed out in turn."""

    def __init__(self, address: str, channels: int = CLIENT_CHANNELS) -> None:
        self.channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(channels)]
        self.stubs: list[RouterAsyncStub] = [router_pb2_grpc.RouterStub(c) for c in self.channels]  # type: ignore[misc]
        self._next = itertools.count()

    def stub(self) -> RouterAsyncStub:
        return self.stubs[next(self._next) % len(self.stubs)]

    async def close(self) -> None:
        await asyncio.gather(*(c.close(None) for c in self.channels))


async def stream_once(
    stub: RouterAsyncStub,
    request: router_pb2.ChatRequest,
    metadata: Metadata = (),
    timeout_s: float = 60.0,
    wait_for_ready: bool = False,
) -> StreamOutcome:
    """Run one turn to its final status, recording when every token arrived."""
    started = time.perf_counter()
    out = StreamOutcome(code="OK", started=started, latency_s=0.0)
    call = stub.ChatStream(request, metadata=metadata, timeout=timeout_s, wait_for_ready=wait_for_ready)
    try:
        async for response in call:
            now = time.perf_counter()
            if response.HasField("delta"):
                ids = list(response.delta.token_ids)
                if out.ttft_s is None and ids:
                    out.ttft_s = now - started
                out.token_ids.extend(ids)
                out.positions.extend(range(response.delta.index, response.delta.index + len(ids)))
                out.token_times.extend([now] * len(ids))
            elif response.HasField("end"):
                end = response.end
                out.replica, out.failovers, out.retries = end.replica, end.failovers, end.retries
                out.finish_reason, out.degraded = end.finish_reason, end.degraded
                out.details = end.error_message
    except grpc.aio.AioRpcError as exc:
        out.code, out.details = exc.code().name, exc.details() or ""
        out.retry_after_s = retry_delay_s(exc.trailing_metadata())
    except asyncio.CancelledError:
        call.cancel()
        raise
    out.latency_s = time.perf_counter() - started
    return out


def retry_delay_s(trailing: Any) -> float | None:
    """The RetryInfo delay in a rich error status (``grpc-status-details-bin``), if any."""
    for key, value in trailing or ():
        if key != "grpc-status-details-bin":
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                return float(info.retry_delay.seconds + info.retry_delay.nanos / 1e9)
    return None


async def run_closed_loop(
    address: str,
    concurrency: int,
    total: int,
    make_request: RequestFactory,
    metadata: Metadata = (),
    timeout_s: float = 60.0,
    stop: asyncio.Event | None = None,
) -> list[StreamOutcome]:
    """``concurrency`` clients, each sending its next turn when the last ended, ``total`` turns in all
    (or until ``stop`` is set)."""
    pool = ClientPool(address, min(CLIENT_CHANNELS, max(1, concurrency)))
    counter = itertools.count()
    results: list[StreamOutcome] = []

    async def client() -> None:
        while (stop is None or not stop.is_set()) and (i := next(counter)) < total:
            results.append(await stream_once(pool.stub(), make_request(i), metadata, timeout_s))

    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        await pool.close()
    return results


async def run_open_loop(
    address: str,
    rate_per_s: float,
    total: int,
    make_request: RequestFactory,
    metadata: Metadata = (),
    timeout_s: float = 60.0,
    rng: random.Random | None = None,
) -> list[StreamOutcome]:
    """Poisson arrivals at ``rate_per_s``; each turn starts on time whether or not earlier ones ended."""
    rng = rng or random.Random(0)
    pool = ClientPool(address)
    tasks: list[asyncio.Task[StreamOutcome]] = []
    next_at = time.perf_counter()
    try:
        for i in range(total):
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(stream_once(pool.stub(), make_request(i), metadata, timeout_s)))
            next_at += rng.expovariate(rate_per_s)
        return list(await asyncio.gather(*tasks))
    finally:
        await pool.close()


@dataclass
class LevelReport:
    """One concurrency level's figures."""

    label: str
    mode: str
    concurrency: int
    requests: int
    succeeded: int
    success_rate: float
    wall_s: float
    requests_per_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    contiguous: int
    errors: dict[str, int] = field(default_factory=dict)


def _ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 2) if values else math.nan


def summarize(
    label: str, mode: str, concurrency: int, outcomes: Sequence[StreamOutcome], wall_s: float
) -> LevelReport:
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    itls = [gap for o in ok for gap in o.inter_token_s]
    tokens = sum(len(o.token_ids) for o in ok)
    return LevelReport(
        label=label,
        mode=mode,
        concurrency=concurrency,
        requests=len(outcomes),
        succeeded=len(ok),
        success_rate=round(len(ok) / len(outcomes), 5) if outcomes else 0.0,
        wall_s=round(wall_s, 3),
        requests_per_s=round(len(ok) / wall_s, 2) if wall_s else 0.0,
        tokens_per_s=round(tokens / wall_s, 1) if wall_s else 0.0,
        ttft_p50_ms=_ms(ttfts, 50),
        ttft_p99_ms=_ms(ttfts, 99),
        itl_p50_ms=_ms(itls, 50),
        itl_p99_ms=_ms(itls, 99),
        latency_p50_ms=_ms([o.latency_s for o in ok], 50),
        latency_p99_ms=_ms([o.latency_s for o in ok], 99),
        contiguous=sum(1 for o in ok if o.contiguous),
        errors=dict(Counter(o.code for o in outcomes if not o.ok)),
    )


def turn_factory(max_tokens: int, prefix: str = "load") -> RequestFactory:
    """Distinct prompts and sessions per turn, so no cache answers and affinity spreads them."""

    def make(i: int) -> router_pb2.ChatRequest:
        return router_pb2.ChatRequest(
            messages=[common_pb2.ChatMessage(role="user", content=f"{prefix} request {i}: tell me a story")],
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            cache=router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS),
        )

    return make


# --- plots -------------------------------------------------------------------------------------


def plot_levels(levels: Sequence[LevelReport], path: Path, title: str) -> None:
    """Throughput and p50/p99 TTFT against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [lv.concurrency for lv in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(xs, [lv.tokens_per_s for lv in levels], marker="o")
    left.set(xscale="log", xlabel="concurrent clients", ylabel="tokens/s", title="throughput")
    right.plot(xs, [lv.ttft_p50_ms for lv in levels], marker="o", label="p50")
    right.plot(xs, [lv.ttft_p99_ms for lv in levels], marker="o", label="p99")
    right.set(xscale="log", xlabel="concurrent clients", ylabel="TTFT (ms)", title="time to first token")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tokens_per_second_series(
    outcomes: Sequence[StreamOutcome], t0: float, bin_s: float = 0.25
) -> tuple[list[float], list[float]]:
    times = sorted(t - t0 for o in outcomes for t in o.token_times)
    if not times:
        return [], []
    bins = int(times[-1] / bin_s) + 1
    counts = [0] * bins
    for t in times:
        counts[max(0, int(t / bin_s))] += 1
    return [i * bin_s for i in range(bins)], [c / bin_s for c in counts]


def plot_failover(
    outcomes: Sequence[StreamOutcome],
    t0: float,
    marks: dict[str, float],
    path: Path,
    title: str,
    until_s: float = math.inf,
) -> None:
    """Tokens/s over time during a kill -9, with the kill and the ejection marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys = tokens_per_second_series(outcomes, t0)
    # The last bins only hold the streams still draining after the load stopped.
    keep = [i for i, x in enumerate(xs) if x + 0.25 <= until_s]
    xs, ys = [xs[i] for i in keep], [ys[i] for i in keep]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(xs, ys, drawstyle="steps-post")
    for (name, at), style in zip(marks.items(), ("r--", "k:", "g-."), strict=False):
        ax.axvline(at, color=style[0], linestyle=style[1:], label=name)
    ax.set(xlabel="seconds", ylabel="tokens/s delivered to clients", title=title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the mesh this benchmark starts for itself --------------------------------------------------


class OwnMesh:
    """Replicas and a router started by the benchmark (synthetic token sources or the real engine)."""

    def __init__(self, replicas: list[Service], router: Service) -> None:
        self.replicas = replicas
        self.router = router

    @classmethod
    async def start(cls, args: argparse.Namespace) -> OwnMesh:
        replicas: list[Service] = []
        for _ in range(args.replicas):
            if args.model:
                replicas.append(Service("services.inference", ["--model", args.model, "--device", "cpu"]))
            else:
                # The synthetic token source: a load-testing fake replica, no model.
                pace = ["--tokens-per-second", str(args.tokens_per_second)]
                replicas.append(Service("services.synthetic", pace))
        for r in replicas:
            r.start()
        await asyncio.gather(*(r.wait_serving() for r in replicas))
        router_args = [
            "--replicas",
            ",".join(r.address for r in replicas),
            "--health-interval-s",
            "0.2",
            "--max-in-flight",
            str(max(2048, 2 * max(args.concurrency_levels))),
            "--policy",
            args.policy,
            "--no-http",  # a gRPC load test: the default HTTP port 8000 may belong to a running mesh
        ]
        router = Service("services.router", router_args).start()
        await router.wait_serving()
        return cls(replicas, router)

    def stop(self) -> None:
        for s in [self.router, *self.replicas]:
            s.stop()


async def failover_phase(
    mesh: OwnMesh, concurrency: int, seconds: float, make_request: RequestFactory, kill_at_s: float
) -> tuple[list[StreamOutcome], float, dict[str, float]]:
    """Closed-loop load for ``seconds``; SIGKILL the busiest replica at ``kill_at_s``."""
    stop = asyncio.Event()
    t0 = time.perf_counter()
    marks: dict[str, float] = {}
    load = asyncio.create_task(
        run_closed_loop(mesh.router.address, concurrency, 10**9, make_request, stop=stop, timeout_s=60)
    )
    await asyncio.sleep(kill_at_s)
    victim = mesh.replicas[0]
    assert victim.proc is not None
    victim.proc.send_signal(signal.SIGKILL)
    marks["kill -9 of one replica"] = time.perf_counter() - t0
    async with grpc.aio.insecure_channel(mesh.router.address) as channel:
        stub: RouterAsyncStub = router_pb2_grpc.RouterStub(channel)  # type: ignore[assignment]
        while time.perf_counter() - t0 < seconds:
            pool = await stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5)
            gone = [
                r
                for r in pool.replicas
                if r.address == victim.address
                and (r.ejected or r.health != router_pb2.REPLICA_HEALTH_SERVING)
            ]
            if gone and "replica out of the pool" not in marks:
                marks["replica out of the pool"] = time.perf_counter() - t0
            await asyncio.sleep(0.05)
    stop.set()
    return await load, t0, marks


# --- command line ------------------------------------------------------------------------------


def _levels(raw: str) -> list[int]:
    try:
        levels = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--concurrency: expected numbers like 10,100,1000, got {raw!r}"
        ) from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("--concurrency: every level must be >= 1")
    return levels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--router", default=None, help="drive this router (host:port); unset = start a mesh here")
    add("--replicas", type=int, default=3, help="replicas of the mesh started here")
    add("--model", default=None, help="real engine replicas with this model; unset = synthetic token sources")
    add("--tokens-per-second", type=float, default=50.0, help="per stream, synthetic token sources only")
    add("--policy", default="auto", help="router --policy for the mesh started here")
    add(
        "--concurrency",
        dest="concurrency_levels",
        type=_levels,
        default=[10, 100, 1000],
        help="levels, e.g. 10,100,1000 (open loop: each level sends N x turns-per-client arrivals)",
    )
    add("--turns-per-client", type=int, default=2, help="turns each client sends per level")
    add(
        "--mode",
        choices=("closed", "open"),
        default="closed",
        help="closed-loop clients or open-loop arrivals",
    )
    add("--rate", type=float, default=50.0, help="open loop: arrivals per second")
    add("--max-tokens", type=int, default=16, help="tokens per answer")
    add("--failover-seconds", type=float, default=0.0, help="also run a kill -9 phase this long (0 = off)")
    add("--failover-concurrency", type=int, default=100, help="clients during the kill -9 phase")
    add("--label", default="synthetic token source", help="what the replicas are, for titles and the JSON")
    add("--plots", default="docs/img", help="directory for the PNG plots")
    add("--json", dest="json_path", default=None, help="write the figures here as JSON")


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    mesh = None if args.router else await OwnMesh.start(args)
    address = args.router or (mesh.router.address if mesh else "")
    slug = ("real" if args.model else "synthetic") + ("-open" if args.mode == "open" else "")
    result: dict[str, Any] = {"label": args.label, "machine": machine(), "levels": []}
    try:
        make = turn_factory(args.max_tokens, f"{slug}-warmup")
        await run_closed_loop(address, 4, 8, make)
        levels = []
        for c in args.concurrency_levels:
            make = turn_factory(args.max_tokens, f"{slug}-c{c}")
            started = time.perf_counter()
            if args.mode == "closed":
                outcomes = await run_closed_loop(address, c, c * args.turns_per_client, make)
            else:
                outcomes = await run_open_loop(address, args.rate, c * args.turns_per_client, make)
            level = summarize(args.label, args.mode, c, outcomes, time.perf_counter() - started)
            levels.append(level)
            print(json.dumps(asdict(level)), flush=True)
        result["levels"] = [asdict(lv) for lv in levels]
        plot_levels(levels, Path(args.plots) / f"load-{slug}.png", f"llm-mesh router, {args.label}")
        if args.failover_seconds and mesh is not None:
            make = turn_factory(args.max_tokens, f"{slug}-failover")
            outcomes, t0, marks = await failover_phase(
                mesh, args.failover_concurrency, args.failover_seconds, make, args.failover_seconds / 3
            )
            summary = summarize(
                args.label, "failover", args.failover_concurrency, outcomes, args.failover_seconds
            )
            moved = [o for o in outcomes if o.failovers]
            result["failover"] = {
                **asdict(summary),
                "marks_s": marks,
                "streams_failed_over": len(moved),
                "failed_over_contiguous": sum(1 for o in moved if o.ok and o.contiguous),
            }
            print(json.dumps(result["failover"]), flush=True)
            plot_failover(
                outcomes,
                t0,
                marks,
                Path(args.plots) / f"failover-{slug}.png",
                f"kill -9 under load ({args.label})",
                until_s=args.failover_seconds,
            )
    finally:
        if mesh is not None:
            mesh.stop()
    return result


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}"


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(_run(args))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    levels = result["levels"]
    return 0 if levels and all(lv["success_rate"] >= 0.999 for lv in levels) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
