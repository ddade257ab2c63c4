"""What the OpenAI HTTP front costs over the router's own gRPC streaming, for the same requests.

    python -m bench.serving --front-only

One router in front of the synthetic token source (a load-testing fake replica,
no model), so what differs between the two paths is only the front:

- **added latency**: streams of 32 unpaced tokens, one at a time, gRPC
  ``Router.ChatStream`` and HTTP SSE ``/v1/chat/completions`` interleaved; p50
  and p99 to the first token and to the end, and HTTP's excess over gRPC;
- **router CPU per relayed token**: 64 concurrent streams of 256 tokens paced
  like an engine (every stream's next token every 20 ms), three rounds per path,
  the paths alternating (and which goes first too); the router process's
  CPU-seconds (psutil) over the tokens relayed, each path's median round. One
  round per path varied 1.19–1.38× on one VM within minutes. The goal: HTTP ≤
  1.2× gRPC's CPU per token.

Clients are the lightest of each kind (grpc.aio's C core; httpx reading raw
SSE lines) and run in this process, not the router's: the router's CPU is
measured alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
import httpx

from bench.router import Service
from bench.serving_peers import router_http_port
from bench.timings import percentile
from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

LATENCY_TURNS = 150
LATENCY_TOKENS = 32
CPU_STREAMS = 64
CPU_TOKENS = 256
CPU_STEP_MS = 20
#: Rounds per path for the CPU figure (alternating paths; each path's median round counts).
CPU_ROUNDS = 3
#: The issue's goal: the HTTP front's router CPU per token at most 1.2× gRPC's.
CPU_RATIO_GOAL = 1.2


def _grpc_turn(i: int, max_tokens: int) -> router_pb2.ChatRequest:
    return router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content=f"front {i}")],
        model="synthetic",
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        cache=router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS),
    )


def _http_body(i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "synthetic",
        "messages": [{"role": "user", "content": f"front {i}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def grpc_stream(stub: Any, i: int, max_tokens: int) -> tuple[float, float, int]:
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    async for response in stub.ChatStream(_grpc_turn(i, max_tokens), timeout=120):
        if response.HasField("delta") and response.delta.token_ids:
            first = first or time.perf_counter()
            tokens += len(response.delta.token_ids)
    end = time.perf_counter()
    return (first or end) - started, end - started, tokens


async def http_stream(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[float, float, int]:
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=_http_body(i, max_tokens)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
            elif first is None and any(c["delta"].get("content") for c in event["choices"]):
                first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - started, end - started, tokens


def _stats(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {"p50_ms": round(percentile(ms, 50), 3), "p99_ms": round(percentile(ms, 99), 3)}


async def _latency(grpc_address: str, http_base: str) -> dict[str, Any]:
    timings: dict[str, list[tuple[float, float, int]]] = {"grpc": [], "http": []}
    async with (
        grpc.aio.insecure_channel(grpc_address) as channel,
        httpx.AsyncClient(base_url=http_base, timeout=120) as client,
    ):
        stub = router_pb2_grpc.RouterStub(channel)
        for i in range(10):  # warm both connections and code paths
            await grpc_stream(stub, -i, LATENCY_TOKENS)
            await http_stream(client, -i, LATENCY_TOKENS)
        for i in range(LATENCY_TURNS):
            timings["grpc"].append(await grpc_stream(stub, i, LATENCY_TOKENS))
            timings["http"].append(await http_stream(client, i, LATENCY_TOKENS))
    out: dict[str, Any] = {}
    for path, rows in timings.items():
        out[path] = {"ttft": _stats([r[0] for r in rows]), "total": _stats([r[1] for r in rows])}
    out["http_added_ms"] = {
        kind: {q: round(out["http"][kind][q] - out["grpc"][kind][q], 3) for q in ("p50_ms", "p99_ms")}
        for kind in ("ttft", "total")
    }
    return out


async def _cpu_per_token(router: Service, http_base: str, path: str) -> dict[str, float]:
    async with (
        grpc.aio.insecure_channel(router.address) as channel,
        httpx.AsyncClient(
            base_url=http_base, timeout=300, limits=httpx.Limits(max_connections=512)
        ) as client,
    ):
        stub = router_pb2_grpc.RouterStub(channel)

        def one(i: int) -> Any:
            if path == "grpc":
                return grpc_stream(stub, 10_000 + i, CPU_TOKENS)
            return http_stream(client, 20_000 + i, CPU_TOKENS)

        await asyncio.gather(*(one(-1 - i) for i in range(8)))  # warm-up, not counted
        cpu0, t0 = router.cpu_seconds(), time.perf_counter()
        rows = await asyncio.gather(*(one(i) for i in range(CPU_STREAMS)))
        cpu, wall = router.cpu_seconds() - cpu0, time.perf_counter() - t0
    tokens = sum(r[2] for r in rows)
    return {
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "router_cpu_s": round(cpu, 3),
        "tokens_per_router_cpu_s": round(tokens / cpu, 1) if cpu else 0.0,
        "router_cpu_us_per_token": round(cpu / tokens * 1e6, 2) if tokens else 0.0,
    }


def _median_round(rows: list[dict[str, float]]) -> dict[str, Any]:
    """The round with the median CPU per token, with every round's figure beside it."""
    ordered = sorted(rows, key=lambda row: row["router_cpu_us_per_token"])
    return {**ordered[len(ordered) // 2], "rounds_us_per_token": [r["router_cpu_us_per_token"] for r in rows]}


def measure_front() -> dict[str, Any]:
    replica = Service("services.synthetic", ["--step-ms", str(CPU_STEP_MS)]).start()
    fast = Service("services.synthetic", []).start()  # unpaced, for the latency turns
    routers: list[Service] = []
    try:
        paced_router = Service(
            "services.router", ["--replicas", replica.address, "--http-port", "0", "--max-in-flight", "4096"]
        ).start()
        routers.append(paced_router)
        unpaced_router = Service("services.router", ["--replicas", fast.address, "--http-port", "0"]).start()
        routers.append(unpaced_router)
        for r in routers:
            asyncio.run(r.wait_serving())
        unpaced_http = f"http://127.0.0.1:{router_http_port(unpaced_router)}"
        paced_http = f"http://127.0.0.1:{router_http_port(paced_router)}"
        latency = asyncio.run(_latency(unpaced_router.address, unpaced_http))
        rounds: dict[str, list[dict[str, float]]] = {"grpc": [], "http": []}
        for round_no in range(CPU_ROUNDS):
            for path in ("grpc", "http") if round_no % 2 == 0 else ("http", "grpc"):
                rounds[path].append(asyncio.run(_cpu_per_token(paced_router, paced_http, path)))
        cpu = {path: _median_round(rows) for path, rows in rounds.items()}
    finally:
        for s in [*routers, replica, fast]:
            s.stop()
    ratio = cpu["http"]["router_cpu_us_per_token"] / cpu["grpc"]["router_cpu_us_per_token"]
    result = {
        "latency": latency,
        "cpu_per_token": cpu,
        "http_over_grpc_cpu_per_token": round(ratio, 3),
        "cpu_goal_met": ratio <= CPU_RATIO_GOAL,
    }
    print(json.dumps(result, indent=2), flush=True)
    return result
