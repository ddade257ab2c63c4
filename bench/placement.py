"""`llm-mesh bench placement`: prefix-aware placement against the load-only policies, same workload.

Three (``--replicas``) real replicas of the model behind one router; groups of requests
behind long shared prefixes (``bench/placement_workload.py``), Poisson arrivals, more
groups than one replica's KV cache (``--kv-blocks``) holds. Each policy gets fresh replicas
(empty caches) and the same requests at the same offsets: ``prefix`` (KV events, the
router's tokenizer), ``wrt``, ``round_robin`` and ``affinity`` with the group as the session
key (session hashing on a group key). Printed per policy: TTFT p50/p90, requests/s, the
share of prompt tokens served from the cache, each replica's share, the most requests one
replica had in flight against the prefix policy's bound; then prefix/WRT ratios against the
issue's goals. The JSON goes under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from bench.placement_workload import PlacementRequest, Result, ratios, summarize, workload
from bench.router import ROOT, Service
from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

if TYPE_CHECKING:
    from services.gen.llmmesh.v1.router_pb2_grpc import RouterAsyncStub

POLICIES = ("prefix", "wrt", "round_robin", "affinity")
BYPASS = router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS)
#: The issue's goals for prefix-aware against weighted response time.
GOAL_TTFT_P90_RATIO = 0.5
GOAL_THROUGHPUT_RATIO = 1.3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--replicas", type=int, default=3, help="real replicas behind the router (≥ 3)")
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated, of " + ", ".join(POLICIES)
    )
    parser.add_argument("--groups", type=int, default=6, help="distinct shared prefixes")
    parser.add_argument(
        "--prefix-tokens", type=int, default=1000, help="about how long each prefix is (500–2,000)"
    )
    parser.add_argument("--requests", type=int, default=60, help="requests per policy")
    parser.add_argument(
        "--rate",
        type=float,
        default=1.0,
        help="Poisson arrivals per second: above what WRT serves on a quiet 2-core machine (≈ 0.6/s)",
    )
    parser.add_argument(
        "--low-rate",
        type=float,
        default=0.0,
        help="a second, below-saturation rate for --low-rate-policies, where TTFT is not queueing (0 = off)",
    )
    parser.add_argument(
        "--low-rate-policies", default="prefix,wrt", help="the policies run at --low-rate too"
    )
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the groups' popularity")
    parser.add_argument(
        "--max-tokens", type=int, default=8, help="answer length: prefill is what is measured"
    )
    parser.add_argument("--block-size", type=int, default=16, help="the replicas' KV block size")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=160,
        help="each replica's KV cache: default ≈ 2.5 prefixes of 1,000 tokens",
    )
    parser.add_argument("--prefix-epsilon", type=float, default=0.5, help="the router's --prefix-epsilon")
    parser.add_argument("--prefix-bound-floor", type=int, default=4, help="the router's --prefix-bound-floor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="JSON path (default bench/results/placement-DATE.json)")


def replica(args: argparse.Namespace) -> Service:
    flags = ["--model", args.model, "--device", "cpu", "--dtype", "float32"]
    flags += ["--kv-blocks", str(args.kv_blocks), "--block-size", str(args.block_size)]
    return Service("services.inference", flags)


def router(args: argparse.Namespace, replicas: Sequence[Service], policy: str) -> Service:
    flags = ["--replicas", ",".join(r.address for r in replicas), "--health-interval-s", "0.2"]
    flags += ["--metrics-port", "0"]  # for the tokenizer's readiness (wait_for_tokenizer)
    flags += ["--policy", policy, "--prefix-epsilon", str(args.prefix_epsilon)]
    flags += ["--prefix-bound-floor", str(args.prefix_bound_floor)]
    if policy == "prefix":
        flags += ["--tokenizer", args.model]
    return Service("services.router", flags)


TOKENIZER_LOADED = "llmmesh_router_prefix_tokenizer_loaded 1.0"


async def wait_for_tokenizer(front: Service, timeout_s: float = 300.0) -> float:
    """Seconds until the router's tokenizer is loaded (its gauge is 1): before that the prefix
    policy places every prompt as uncached, which is not what is measured."""
    url = f"http://127.0.0.1:{front.metrics_port}/metrics"
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        except OSError:
            body = ""
        if TOKENIZER_LOADED in body:
            return time.monotonic() - started
        await asyncio.sleep(0.5)
    raise TimeoutError(f"the router's tokenizer did not load in {timeout_s:.0f} s")


async def one(
    stub: RouterAsyncStub, request: PlacementRequest, by_group: bool, max_tokens: int, t0: float
) -> Result:
    await asyncio.sleep(max(0.0, request.at_s - (time.perf_counter() - t0)))
    started = time.perf_counter()
    chat = router_pb2.ChatRequest(
        messages=[
            common_pb2.ChatMessage(role="system", content=request.system),
            common_pb2.ChatMessage(role="user", content=request.question),
        ],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        session_id=f"group-{request.group}" if by_group else "",
        cache=BYPASS,
    )
    first: float | None = None
    try:
        async for message in stub.ChatStream(chat, timeout=600):
            if message.HasField("delta") and first is None:
                first = time.perf_counter()
            if message.HasField("end"):
                end, now = message.end, time.perf_counter()
                return Result(
                    ok=True,
                    started_s=started - t0,
                    ended_s=now - t0,
                    ttft_s=(first or now) - started,
                    replica=end.replica,
                    prompt_tokens=end.usage.prompt_tokens,
                    cached_prompt_tokens=end.usage.cached_prompt_tokens,
                    completion_tokens=end.usage.completion_tokens,
                )
    except grpc.aio.AioRpcError as exc:
        return Result(ok=False, error=f"{exc.code().name}: {exc.details()}"[:300])
    return Result(ok=False, error="stream ended without TurnEnd")


async def run_policy(
    args: argparse.Namespace, policy: str, requests: Sequence[PlacementRequest]
) -> dict[str, object]:
    replicas = [replica(args).start() for _ in range(args.replicas)]
    front: Service | None = None
    try:
        await asyncio.gather(*(r.wait_serving() for r in replicas))
        front = router(args, replicas, policy).start()
        await front.wait_serving()
        if policy == "prefix":
            waited = await wait_for_tokenizer(front)
            print(f"prefix: the router's tokenizer loaded {waited:.0f} s after it served")
        await asyncio.sleep(1.0)  # health polls and, for prefix, the KV-event snapshots
        async with grpc.aio.insecure_channel(front.address) as channel:
            stub: RouterAsyncStub = router_pb2_grpc.RouterStub(channel)  # type: ignore[assignment]
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(one(stub, r, policy == "affinity", args.max_tokens, t0) for r in requests)
            )
        row = summarize(results, [r.address for r in replicas], args.prefix_epsilon, args.prefix_bound_floor)
        return {"policy": policy, **row}
    finally:
        if front is not None:
            front.stop()
        for r in replicas:
            r.stop()


def run_rate(
    args: argparse.Namespace, rate: float, policies: Sequence[str]
) -> tuple[dict[str, dict[str, object]], dict[str, object]]:
    """Every policy through the same workload at ``rate``; the rows and the prefix/WRT goals."""
    requests = workload(args.requests, args.groups, args.prefix_tokens, rate, args.seed, args.skew)
    rows: dict[str, dict[str, object]] = {}
    for policy in policies:
        rows[policy] = row = asyncio.run(run_policy(args, policy, requests))
        print(
            f"{rate:.2f}/s {policy:12s} TTFT p50 {row['ttft_ms_p50']:8.1f} ms  p90 {row['ttft_ms_p90']:8.1f} ms  "
            f"{row['requests_per_s']:6.3f} req/s  cached {row['cached_prompt_share']:.0%}  "
            f"max in flight {row['max_in_flight_per_replica']} ({row['placements_over_bound']} over bound)  "
            f"failed {row['failed']}  share {list(row['replica_share'].values())}",  # type: ignore[attr-defined]
            flush=True,
        )
    goals: dict[str, object] = {}
    if "prefix" in rows and "wrt" in rows:
        ratio = ratios(rows["prefix"], rows["wrt"])
        goals = {
            **ratio,
            "meets_ttft_goal": ratio["ttft_p90_prefix_over_wrt"] <= GOAL_TTFT_P90_RATIO,
            "meets_throughput_goal": ratio["throughput_prefix_over_wrt"] >= GOAL_THROUGHPUT_RATIO,
        }
        goals["prefix_within_bound"] = rows["prefix"]["placements_over_bound"] == 0
        print(f"{rate:.2f}/s prefix/wrt: {goals}", flush=True)
    return rows, goals


def run(args: argparse.Namespace) -> int:
    policies = [p for p in args.policies.split(",") if p]
    low_policies = [p for p in args.low_rate_policies.split(",") if p] if args.low_rate > 0 else []
    unknown = [p for p in [*policies, *low_policies] if p not in POLICIES]
    if unknown or args.replicas < 1 or args.groups < 1 or args.requests < 1 or args.rate <= 0:
        print(f"bad flags: policies {unknown or 'ok'}; --replicas, --groups, --requests ≥ 1; --rate > 0")
        return 2
    rows, goals = run_rate(args, args.rate, policies)
    low: dict[str, object] = {}
    if low_policies:
        low_rows, low_goals = run_rate(args, args.low_rate, low_policies)
        low = {"rate": args.low_rate, "policies": low_rows, "goals": low_goals}
    now = datetime.now(UTC)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"placement-{now:%Y-%m-%d-%H%M}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"date": now.isoformat(), "config": config, "policies": rows, "goals": goals}
    if low:
        result["low_rate"] = low
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.placement", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
