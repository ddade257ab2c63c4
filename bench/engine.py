"""Engine benchmark: the llm-mesh engine against naive, static and continuous-batching HF generation.

    python -m bench.engine --workload uniform --json bench/results/engine-uniform.json
    llm-mesh bench engine --workload mixed --only llm_mesh,hf_static

Methods run in the same process on the same model, dtype and prompts, interleaved round
by round (the order rotates each round) because this machine's speed drifts up to 2×
within minutes; the table and JSON give per-method medians over rounds. ``--isolate``
runs each method's round in a fresh process instead (``bench/isolation.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.timings import MethodRun, Summary, median_summary, summarize
from bench.workloads import Workload

METHODS = ("llm_mesh", "llm_mesh_eager", "naive", "hf_static", "hf_continuous")
#: Run unless --only says otherwise; llm_mesh_eager (the engine with --no-compile, beside a
#: --compile llm_mesh in the same run) is asked for by name.
DEFAULT_METHODS = ("llm_mesh", "naive", "hf_static", "hf_continuous")
DEFAULT_MODEL = "models/SmolLM2-135M-Instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=("uniform", "mixed", "structured"),
        default="uniform",
        help="structured: JSON-schema requests vs the same free ones, and transformers with llguidance "
        "(bench/structured.py)",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="local model directory (default: %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--only", default=",".join(DEFAULT_METHODS), help=f"comma-separated subset of {','.join(METHODS)}"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results document here")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians are reported")
    parser.add_argument("--num-requests", type=int, default=None, help="default: 64 uniform, 128 mixed")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="uniform: tokens per request (64); mixed: upper bound (256)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument(
        "--naive-requests",
        type=int,
        default=8,
        help="time naive on this many requests and extrapolate the rest (0 = run them all)",
    )
    parser.add_argument("--arrival-rate", type=float, default=2.0, help="mixed: Poisson arrivals per second")
    parser.add_argument("--seed", type=int, default=0, help="mixed: seed for arrivals and lengths")
    parser.add_argument(
        "--model-impl",
        choices=("auto", "native", "transformers"),
        default="auto",
        help="llm-mesh forward: native Llama (auto for SmolLM2) or transformers' modules",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="torch.compile llm-mesh's forward (native: per-layer kernels; transformers: decode step)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=64, help="llm-mesh running batch and static wave size"
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="llm-mesh per-step token budget"
    )
    parser.add_argument(
        "--warmup",
        choices=("short", "full"),
        default="short",
        help="off-the-clock warm-up per method: two 2-token requests, or the whole workload once "
        "(lets a compiled engine see every shape before it is timed)",
    )
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="run each method's warm-up and round in a fresh process of its own, rounds interleaved "
        "as usual: engines sharing a process were measured to slow each other (docs/benchmarks.md)",
    )
    # Internal: the process --isolate starts for one method and one round (bench/isolation.py).
    parser.add_argument("--child-args", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cb-page-size", type=int, default=256, help="transformers CB tokens per KV page")
    parser.add_argument(
        "--cb-num-blocks",
        type=int,
        default=None,
        help="transformers CB KV blocks (default: 64 on CPU, as BENCHMARKS.md; on CUDA its own sizing)",
    )


def continuous_batching_sizes(num_blocks: int | None, device: str) -> tuple[int | None, int | None]:
    """(KV blocks, max batch tokens) for transformers' continuous batching.

    On CPU the sizes BENCHMARKS.md gave the peer; on a GPU transformers sizes both from
    free memory (None), as a user of it there would get, unless --cb-num-blocks is given.
    """
    from bench.hf_peers import CB_MAX_BATCH_TOKENS, CB_NUM_BLOCKS

    if device == "cpu":
        return num_blocks or CB_NUM_BLOCKS, CB_MAX_BATCH_TOKENS
    return num_blocks, None


def parse_methods(only: str) -> list[str]:
    """The requested methods in the canonical order; unknown names are a usage error."""
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(METHODS))
    if unknown:
        raise ValueError(f"--only: unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if not names:
        raise ValueError("--only: name at least one method")
    return [m for m in METHODS if m in names]


def build_workload(args: argparse.Namespace, tokenizer: Any) -> Workload:
    from bench import workloads

    if args.workload == "uniform":
        return workloads.uniform(tokenizer, args.num_requests or 64, args.max_tokens or 64)
    top = args.max_tokens or 256
    return workloads.mixed(
        tokenizer,
        args.num_requests or 128,
        arrival_rate=args.arrival_rate,
        max_tokens=(min(16, top), top),
        seed=args.seed,
    )


def warmup_workload(workload: Workload) -> Workload:
    """Two short requests at once: pays one-time costs (allocator, kernels) off the clock."""
    from bench.workloads import BenchRequest

    picked = [BenchRequest(f"warm{r.request_id}", r.prompt_token_ids, 2, 0.0) for r in workload.requests[:2]]
    return Workload("warmup", picked)


def machine_description(device: str = "cpu") -> str:
    """CPU model and core count, and the GPU when the run used one; recorded with every result."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    described = f"{model}, {os.cpu_count()} CPU(s), {platform.system()} {platform.release()}"
    if device.startswith("cuda"):
        import torch

        described = f"{torch.cuda.get_device_name(device)}; {described}"
    return described


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 1 when fp32 tokens differ between methods (they must not), 2 on bad usage."""
    try:
        methods = parse_methods(args.only)
        if args.rounds < 1:
            raise ValueError("--rounds must be >= 1")
    except ValueError as exc:
        print(f"bench engine: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.workload == "structured":
        from bench import structured

        return structured.run(args)

    import torch
    import transformers
    from rich.console import Console

    from bench import report

    # Piped into a file or CI log, rich would wrap the table at 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 120)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if not (Path(args.model) / "config.json").exists():
        print(f"bench engine: no model at {args.model} (run `make model`)", file=sys.stderr)
        return 2

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    pad_token_id = int(
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    workload = build_workload(args, tokenizer)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"

    cb_sizes = continuous_batching_sizes(args.cb_num_blocks, device)
    # The ceiling of this machine and dtype at the batch's rows, before the runs and after them
    # (the better of the two counts): "close to the limit" measured, in this run.
    from bench.matmul_ceiling import best_of, ceiling_tok_s

    ceilings = (
        []
        if args.child_out is not None
        else [ceiling_tok_s(args.max_num_seqs, getattr(torch, args.dtype), device)]
    )
    if args.isolate and args.child_out is None:
        from bench import isolation

        per_round, last_runs, notes = isolation.run_isolated(args, methods, console)
        model_impl = None
    else:
        per_round, last_runs, notes, model_impl = _measure_in_process(
            args, methods, workload, device, cb_sizes, pad_token_id, console
        )
    if args.child_out is not None:
        from bench import isolation

        (method,) = methods
        isolation.write_child_result(args.child_out, per_round[0][method], last_runs[method], notes)
        return 0

    results = {m: median_summary([r[m] for r in per_round]) for m in methods}
    ceilings.append(ceiling_tok_s(args.max_num_seqs, getattr(torch, args.dtype), device))
    ceiling = best_of(ceilings)
    ceiling["share"] = {m: results[m].tok_s / ceiling["tok_s"] for m in methods}
    ceiling["step_linears_share"] = {m: results[m].tok_s / ceiling["step_linears_tok_s"] for m in methods}
    check = report.check_tokens({m: last_runs[m] for m in methods})
    ratio_table = report.ratios(results)
    if args.dtype != "float32" and check.total_mismatches:
        notes.append(
            "bf16 greedy tokens drift between methods after a few dozen tokens; compare tokens in fp32"
        )
    document: dict[str, Any] = {
        "workload": workload.name,
        "model": args.model,
        "device": device,
        "dtype": args.dtype,
        "results": {m: results[m].as_dict() for m in methods},
        "ratios": ratio_table,
        "targets": report.targets(workload.name, ratio_table),
        "token_check": check.as_dict(),
        "ceiling": ceiling,
        "rounds": args.rounds,
        "per_round": [{m: s.as_dict() for m, s in r.items()} for r in per_round],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_description(device),
        "threads": args.threads,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "settings": {
            "num_requests": len(workload.requests),
            "total_tokens": workload.total_tokens,
            "compile": args.compile,
            "model_impl": model_impl,
            "isolated": args.isolate,
            "max_num_seqs": args.max_num_seqs,
            "naive_requests": args.naive_requests,
            "warmup": args.warmup,
            "arrival_rate": args.arrival_rate if workload.name == "mixed" else None,
            "seed": args.seed if workload.name == "mixed" else None,
            "cb_num_blocks": cb_sizes[0],
            "cb_max_batch_tokens": cb_sizes[1],
            "cb_page_size": args.cb_page_size,
        },
        "notes": notes,
    }
    report.print_report(console, document, results, check, notes)
    measured = " / ".join(f"{m['gflops']:.0f}" for m in ceiling["measurements"])
    console.print(
        f"matmul ceiling ({args.dtype}, {ceiling['rows']} rows, this machine, best of before and after "
        f"the runs: {measured}): "
        f"{ceiling['gflops']:.1f} GFLOP/s ≈ {ceiling['tok_s']:,.0f} tok/s; share: "
        + ", ".join(f"{m} {share:.0%}" for m, share in ceiling["share"].items())
    )
    console.print(
        f"one step's linears, each layer its own weights (this run): {ceiling['step_linears_gflops']:.1f} "
        f"GFLOP/s ≈ {ceiling['step_linears_tok_s']:,.0f} tok/s "
        f"({ceiling['step_linears_gflops'] / ceiling['gflops']:.0%} of the ceiling); share: "
        + ", ".join(f"{m} {share:.0%}" for m, share in ceiling["step_linears_share"].items())
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    if args.dtype == "float32" and check.total_mismatches:
        console.print("[red]fp32 greedy tokens differ between methods: a correctness bug, not noise[/red]")
        return 1
    return 0


def _measure_in_process(
    args: argparse.Namespace,
    methods: list[str],
    workload: Workload,
    device: str,
    cb_sizes: tuple[int | None, int | None],
    pad_token_id: int,
    console: Any,
) -> tuple[list[dict[str, Summary]], dict[str, MethodRun], list[str], str | None]:
    """Every method built in this process, warmed, then timed round by round (order rotating)."""
    import torch
    import transformers

    from bench import hf_peers, mesh_method

    runners: dict[str, Callable[[Workload], MethodRun]] = {}
    engine: Any = None
    if any(not m.startswith("llm_mesh") for m in methods):
        console.print(f"loading HF model ({args.dtype}) …")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=getattr(torch, args.dtype)
        ).to(device)
        hf_model.eval()
        sample = args.naive_requests or None
        runners["naive"] = lambda w: hf_peers.run_naive(
            hf_model, w, pad_token_id, sample if w is workload else None
        )
        runners["hf_static"] = lambda w: hf_peers.run_static(hf_model, w, pad_token_id, args.max_num_seqs)
        runners["hf_continuous"] = lambda w: hf_peers.run_continuous(
            hf_model, w, pad_token_id, args.cb_page_size, *cb_sizes
        )
    if "llm_mesh" in methods:
        console.print(f"building llm-mesh engine ({args.dtype}, {args.model_impl}, compile={args.compile}) …")
        engine = mesh_method.build_engine(
            args.model,
            args.dtype,
            device,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            compile_model=args.compile,
            model_impl=args.model_impl,
        )
        runners["llm_mesh"] = lambda w: mesh_method.run_llm_mesh(engine, w)
    if "llm_mesh_eager" in methods:
        eager_engine = mesh_method.build_engine(
            args.model,
            args.dtype,
            device,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            compile_model=False,
            model_impl=args.model_impl,
        )
        runners["llm_mesh_eager"] = lambda w: mesh_method.run_llm_mesh(eager_engine, w)

    warm = warmup_workload(workload) if args.warmup == "short" else workload
    for method in methods:
        console.print(f"warming up {method} …")
        runners[method](warm)

    per_round: list[dict[str, Summary]] = []
    last_runs: dict[str, MethodRun] = {}
    notes: list[str] = []
    for index in range(args.rounds):
        # Rotate the order so no method always runs first (or right after another).
        order = methods[index % len(methods) :] + methods[: index % len(methods)]
        summaries: dict[str, Summary] = {}
        for method in order:
            console.print(f"round {index + 1}/{args.rounds}: {method} …")
            method_run = runners[method](workload)
            summaries[method] = summarize(method_run)
            last_runs[method] = method_run
            if method_run.note and method_run.note not in notes:
                notes.append(method_run.note)
            console.print(f"  {method}: {summaries[method].tok_s:.1f} tok/s")
        per_round.append(summaries)
    return per_round, last_runs, notes, engine.runner.model_impl if engine is not None else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.child_args is not None:  # one method and round of an --isolate run
        from bench import isolation

        return run(isolation.child_namespace(args.child_args, args.child_out))
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
