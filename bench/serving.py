"""Serving benchmark: the same OpenAI-client workload against llm-mesh's HTTP front and its peers.

    bash bench/peers/build_llama_server.sh      # once: llama.cpp's server, f32 and bf16 GGUFs
    python -m bench.serving                     # every server, then the HTTP front's overhead
    python -m bench.serving --dtype bfloat16 --no-front   # every server in bf16
    python -m bench.serving --rounds 3 --no-front         # every server 3 times, in turn
    llm-mesh bench serving --requests 24 --servers llm_mesh,transformers --no-front

One seeded workload (``bench/serving_client.py``: Poisson arrivals, mixed
prompt and output lengths, streamed, temperature 0) is sent in one run to each
server in turn (``bench/serving_peers.py``): llm-mesh (router HTTP front + one
replica), ``transformers serve --continuous-batching``, and llama.cpp's
``llama-server`` with parallel slots (a GGUF of the same checkpoint at the run's
``--dtype``, and the packaged Q4_1 GGUF as a reference row). Prints TTFT / ITL / latency percentiles
and output tokens/s per server, and llm-mesh's ratios to the best peer at the
same precision. With ``--rounds N`` every server is started once and runs the
workload N times, the servers taking turns while the others are paused
(SIGSTOP); ratios are then the medians of the rounds' ratios. With ``--baseline
PATH`` llm-mesh from another checkout runs too, as ``llm_mesh_baseline``, and the
working tree's figures over it are printed: a change measured before and after in
one run, which this VM's drift makes the only fair way. Then ``bench/serving_front.py``: the HTTP front's added
latency over ``Router.ChatStream`` and the router's CPU per relayed token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.load import machine
from bench.matmul_ceiling import gflops
from bench.serving_client import arrival_bound, run_load, summarize, workload
from bench.serving_peers import CHECKPOINT, DTYPES, STARTERS, NotAvailable, RunningServer, start_llm_mesh

#: Peers run at llm-mesh's precision (--dtype); the Q4_1 row is a reference, not a comparison.
SAME_PRECISION_PEERS = ("transformers", "llama_cpp")
#: Rows of the matmul ceiling for outputs (a decode batch of this workload's size) and prompts (a chunk).
DECODE_ROWS = 48
PREFILL_ROWS = 1024
#: The issue's goals: ≥ 2× the better peer's tokens/s at equal or better TTFT p50.
TOKENS_RATIO_GOAL = 2.0
#: llm-mesh run from another checkout (``--baseline``): before/after a change, in one run.
BASELINE = "llm_mesh_baseline"
#: Both count as llm-mesh: failing to start fails the run, and neither is a peer.
MESH_SERVERS = ("llm_mesh", BASELINE)


def linear_gflop_per_token() -> float:
    """2 FLOPs per weight per token (the matmuls), from the checkpoint's safetensors header."""
    import math
    import struct

    with (CHECKPOINT / "model.safetensors").open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    params = sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return 2 * params / 1e9


def _token_counter() -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json"))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


async def _warm_up(server: RunningServer, count_tokens: Any) -> None:
    """Two short requests first: lazy loading, first-call compilation and thread pools are not timed."""
    for request in workload(2, float("inf"), seed=99):
        outcomes, _ = await run_load(server.base_url, server.model, [request], count_tokens)
        if not outcomes[0].ok:
            raise RuntimeError(f"{server.name} warm-up failed: {outcomes[0].error}")


def start(name: str, args: argparse.Namespace) -> RunningServer | dict[str, Any]:
    """The started server, or its "not run" row when a peer cannot start here."""
    try:
        if name == BASELINE:
            replica_args = shlex.split(args.mesh_replica_args or "")
            return start_llm_mesh(args.dtype, replica_args, root=args.baseline, name=BASELINE)
        if name == "llm_mesh" and args.mesh_replica_args:
            return start_llm_mesh(args.dtype, shlex.split(args.mesh_replica_args))
        return STARTERS[name](args.dtype)
    except (RuntimeError, TimeoutError) as exc:
        # A peer that is missing or dies while starting (llama.cpp's Q4 server was killed by
        # SIGILL on an AMX VM) is reported as not run, with why; the others' figures still
        # count. llm-mesh itself failing to start fails the run.
        if name in MESH_SERVERS and not isinstance(exc, NotAvailable):
            raise
        text = str(exc).strip()
        reason = text.splitlines()[0] if text else type(exc).__name__
        print(f"  {name}: not run ({reason})", flush=True)
        return {"server": name, "not_run": reason}


def measure(name: str, args: argparse.Namespace, count_tokens: Any) -> dict[str, Any]:
    """Start ``name``, run the workload against it, stop it."""
    server = start(name, args)
    if isinstance(server, dict):
        return server
    try:
        return measure_on(server, args, count_tokens)
    finally:
        server.stop()


def measure_on(
    server: RunningServer, args: argparse.Namespace, count_tokens: Any, seed: int | None = None
) -> dict[str, Any]:
    """One run of the workload (``seed``, else ``args.seed``) against a started server, with the
    ceiling measured just before."""
    name = server.name
    asyncio.run(_warm_up(server, count_tokens))
    requests = workload(args.requests, args.rate, args.seed if seed is None else seed)
    # This VM drifts up to 2x within minutes: the ceiling is measured just before each server.
    dtype = getattr(torch, args.dtype)
    ceiling = {rows: gflops(rows, 0.3, dtype) for rows in (DECODE_ROWS, PREFILL_ROWS)}
    outcomes, wall = asyncio.run(
        run_load(server.base_url, server.model, requests, count_tokens, args.max_concurrency)
    )
    row: dict[str, Any] = {"server": name, **summarize(outcomes, wall)}
    # What the machine did for it: the weight matmuls over every prompt and output token.
    per_token = linear_gflop_per_token()
    row["linear_gflop_per_s"] = round(row["processed_tokens_per_s"] * per_token, 1)
    # The least time any server needs for these tokens: prompts at the big-GEMM ceiling,
    # outputs at the decode-batch one (attention and everything else only add to it).
    floor_s = (
        row["prompt_tokens"] * per_token / ceiling[PREFILL_ROWS]
        + row["completion_tokens"] * per_token / ceiling[DECODE_ROWS]
    )
    span = row["completion_tokens"] / row["output_tokens_per_s"] if row["output_tokens_per_s"] else 0.0
    row["ceiling_gflop_per_s"] = {str(k): round(v, 1) for k, v in ceiling.items()}
    row["matmul_floor_s"] = round(floor_s, 1)
    row["ceiling_output_tokens_per_s"] = round(row["completion_tokens"] / floor_s, 1) if floor_s else 0.0
    row["share_of_ceiling"] = round(floor_s / span, 2) if span else 0.0
    bound = arrival_bound(requests, row["completion_tokens"])
    row["arrival_bound_output_tokens_per_s"] = round(bound, 1) if bound is not None else None
    arrivals = f", arrivals allow {bound:.0f}" if bound is not None else ""
    print(
        f"  {name:17s} {row['output_tokens_per_s']:6.1f} tok/s  TTFT p50 {row['ttft_ms_p50']:8.0f} ms"
        f"  ITL p50 {row['itl_ms_p50']:6.1f} ms  {row['linear_gflop_per_s']:5.1f} GFLOP/s"
        f"  (ceiling {row['ceiling_output_tokens_per_s']:.0f} tok/s{arrivals})  failed {row['failed']}",
        flush=True,
    )
    return row


def measure_rounds(
    names: list[str], args: argparse.Namespace, count_tokens: Any
) -> list[list[dict[str, Any]]]:
    """Every server started once, then ``args.rounds`` rounds in which each runs the workload in
    turn while the others are paused (SIGSTOP); each round starts one server later in the order,
    so no server always runs first or last. Returns each round's rows, in ``names`` order.

    Round k sends the workload of seed ``args.seed + k`` (every server the same one within a
    round): a server started once keeps its caches, and the same prompts again would be prefix
    cache hits (all at once, llm-mesh's TTFT p50 fell from 2.83 s in round 1 to 0.79 s in round
    2 when every round repeated them, 00:39 UTC 2026-12-06). Round 1 is the single run's workload.

    Why: this VM drifts up to 2x within minutes, and one server measured in a slow minute skews
    a single run's ratio (the 4/s run at 00:17 UTC 2026-12-06: llm-mesh's ceiling measured half
    the peer's). Rounds give each pair of servers several neighbouring minutes to compare in.
    """
    started: dict[str, RunningServer] = {}
    not_run: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            outcome = start(name, args)
            if isinstance(outcome, dict):
                not_run[name] = outcome
                continue
            outcome.pause()  # the next server starts (llm-mesh compiles) with the CPUs to itself
            started[name] = outcome
        rounds: list[list[dict[str, Any]]] = []
        for index in range(args.rounds):
            print(f"round {index + 1}/{args.rounds}", flush=True)
            order = names[index % len(names) :] + names[: index % len(names)]
            rows: dict[str, dict[str, Any]] = dict(not_run)
            for name in order:
                server = started.get(name)
                if server is None:
                    continue
                server.resume()
                try:
                    rows[name] = measure_on(server, args, count_tokens, seed=args.seed + index)
                finally:
                    server.pause()
            rounds.append([rows[name] for name in names])
        return rounds
    finally:
        for server in started.values():
            server.stop()


def median_rows(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each server's median figures over the rounds (its per-round tokens/s kept beside them)."""
    rows: list[dict[str, Any]] = []
    for runs in zip(*rounds, strict=True):
        if "not_run" in runs[0]:
            rows.append(runs[0])
            continue
        row = dict(runs[0])
        for key, value in runs[0].items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                row[key] = statistics.median(r[key] for r in runs)
            elif isinstance(value, dict):  # the ceiling by rows
                row[key] = {k: statistics.median(r[key][k] for r in runs) for k in value}
        row["failed"] = max(r["failed"] for r in runs)
        row["rounds_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in runs]
        rows.append(row)
    return rows


def ratios_over_rounds(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Each round's verdict, and the verdict on the medians of its ratios."""
    per_round = [ratios(rows) for rows in rounds]
    judged = [r for r in per_round if r]
    if not judged:
        return {}
    tok = statistics.median(r["tokens_per_s_ratio"] for r in judged)
    ttft = statistics.median(r["ttft_p50_ratio_peer_over_mesh"] for r in judged)
    return {
        "tokens_per_s_ratio": round(tok, 2),
        "ttft_p50_ratio_peer_over_mesh": round(ttft, 2),
        "goal_met": tok >= TOKENS_RATIO_GOAL and ttft >= 1.0,
        "rounds_goal_reachable": sum(1 for r in judged if r["goal_reachable"]),
        "per_round": per_round,
    }


def _ran(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The rows of servers that ran with no failed request, by server name."""
    return {r["server"]: r for r in rows if "not_run" not in r and not r.get("failed")}


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """llm-mesh against the best same-precision peer that ran (by tokens/s)."""
    by_name = _ran(rows)
    mesh = by_name.get("llm_mesh")
    peers = [by_name[p] for p in SAME_PRECISION_PEERS if p in by_name]
    if mesh is None or not peers:
        return {}
    best = max(peers, key=lambda r: r["output_tokens_per_s"])
    tok = mesh["output_tokens_per_s"] / best["output_tokens_per_s"]
    ttft = best["ttft_ms_p50"] / mesh["ttft_ms_p50"] if mesh["ttft_ms_p50"] else float("inf")
    # Under Poisson arrivals no server passes the arrivals' bound; where it lies below the goal
    # times the peer, the goal was out of every server's reach on this workload, whatever its speed.
    bound = mesh.get("arrival_bound_output_tokens_per_s")
    return {
        "best_peer": best["server"],
        "tokens_per_s_ratio": round(tok, 2),
        "ttft_p50_ratio_peer_over_mesh": round(ttft, 2),
        "goal_met": tok >= TOKENS_RATIO_GOAL and ttft >= 1.0,
        "goal_reachable": bound is None or bound >= TOKENS_RATIO_GOAL * best["output_tokens_per_s"],
        "vs_each": {
            name: round(mesh["output_tokens_per_s"] / r["output_tokens_per_s"], 2)
            for name, r in by_name.items()
            if name not in MESH_SERVERS
        },
    }


def versus_baseline(rows: list[dict[str, Any]]) -> dict[str, float]:
    """This checkout's llm-mesh over ``--baseline``'s on the same workload; above 1 is better
    for each figure (more tokens/s, a lower TTFT or ITL p50)."""
    by_name = _ran(rows)
    mesh, base = by_name.get("llm_mesh"), by_name.get(BASELINE)
    if mesh is None or base is None:
        return {}

    def lower_by(key: str) -> float:
        return round(base[key] / mesh[key], 2) if mesh[key] else float("inf")

    return {
        "tokens_per_s": round(mesh["output_tokens_per_s"] / base["output_tokens_per_s"], 2),
        "ttft_p50_lower_by": lower_by("ttft_ms_p50"),
        "itl_p50_lower_by": lower_by("itl_ms_p50"),
    }


def versus_baseline_over_rounds(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Each round's before/after, and the median of each figure over the rounds."""
    per_round = [versus_baseline(rows) for rows in rounds]
    judged = [r for r in per_round if r]
    if not judged:
        return {}
    medians: dict[str, Any] = {key: round(statistics.median(r[key] for r in judged), 2) for key in judged[0]}
    return {**medians, "per_round": per_round}


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", default=",".join(STARTERS), help=f"comma list of {', '.join(STARTERS)}")
    parser.add_argument("--requests", type=int, default=48, help="requests per server")
    parser.add_argument(
        "--rate", type=float, default=4.0, help="Poisson arrivals per second (inf: all at once)"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (same requests for every server)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="every server's precision (the Q4 row aside)"
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="client-side cap on requests in flight"
    )
    parser.add_argument(
        "--mesh-replica-args",
        default="",
        help="extra flags for llm-mesh's replica, e.g. '--max-num-batched-tokens 512'",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of every server in turn, the idle ones paused; ratios are the rounds' medians",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another llm-mesh checkout (generated code included, e.g. a git worktree of the commit "
        "before) run beside this one as server llm_mesh_baseline: before/after in one run",
    )
    parser.add_argument("--no-front", action="store_true", help="skip the HTTP-front overhead part")
    parser.add_argument("--front-only", action="store_true", help="only the HTTP-front overhead part")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")


def run(args: argparse.Namespace) -> int:
    from bench import serving_front

    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if args.rounds < 1:
        print(f"--rounds must be at least 1, got {args.rounds}", file=sys.stderr)
        return 2
    unknown = sorted(set(names) - set(STARTERS))
    if unknown:
        print(f"unknown --servers {unknown}; choose from {sorted(STARTERS)}", file=sys.stderr)
        return 2
    if args.baseline is not None:
        missing = [
            p
            for p in ("services/inference", "services/router", "services/gen")
            if not (args.baseline / p).is_dir()
        ]
        if missing:
            print(
                f"--baseline {args.baseline} is not an llm-mesh checkout with its generated code "
                f"(missing {', '.join(missing)}; run `python -m services.common.protogen` there)",
                file=sys.stderr,
            )
            return 2
        names = [*names, BASELINE]
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "commit": commit(),
        "workload": {"requests": args.requests, "rate": args.rate, "seed": args.seed, "dtype": args.dtype},
    }
    if not args.front_only:
        count_tokens = _token_counter()
        print(f"serving: {args.requests} requests at {args.rate}/s, seed {args.seed}", flush=True)
        if args.rounds > 1:
            rounds = measure_rounds(names, args, count_tokens)
            results["rounds"] = rounds
            results["servers"] = median_rows(rounds)
            results["ratios"] = ratios_over_rounds(rounds)
            if args.baseline is not None:
                results["versus_baseline"] = versus_baseline_over_rounds(rounds)
        else:
            rows = [measure(name, args, count_tokens) for name in names]
            results["servers"] = rows
            results["ratios"] = ratios(rows)
            if args.baseline is not None:
                results["versus_baseline"] = versus_baseline(rows)
        print(json.dumps(results["ratios"], indent=2), flush=True)
        if args.baseline is not None:
            print(
                "this checkout over --baseline:", json.dumps(results["versus_baseline"], indent=2), flush=True
            )
    if not args.no_front:
        results["front"] = serving_front.measure_front()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
