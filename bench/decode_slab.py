"""Decode steps over long conversations: the decode slab against gathering from the paged cache.

    python -m bench.decode_slab                      # 8 conversations of 1,500 tokens, 3 rounds
    llm-mesh bench decode-slab --rows 64 --prompt-tokens 400

Two engines in one process, identical but for ``decode_slab_mib``: the default budget
(the slab, when the batch fits it) and 0 (every decode step gathers each row's blocks
from the paged cache). Each round runs the same prompts through both, alternating which
goes first; a step counts when every conversation decodes in it (no prefill). Prints
the median full-batch decode step of each, their ratio, and whether both produced the
same greedy tokens (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.engine import machine_description
from bench.workloads import WORD_LIST

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rows", type=int, default=8, help="conversations decoding together")
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="each conversation's context")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens decoded per conversation")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--slab-mib", type=int, default=None, help="the slab's budget (default: the engine's)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the figures here as JSON")


def prompts(tokenizer: Any, rows: int, length: int, seed: int = 0) -> list[list[int]]:
    """``rows`` distinct prompts of exactly ``length`` tokens of plain text (no shared prefix)."""
    rng = random.Random(seed)
    words = WORD_LIST.split()
    out = []
    for _ in range(rows):
        ids = tokenizer.encode(
            " ".join(rng.choice(words) for _ in range(length * 2)), add_special_tokens=False
        )
        if len(ids) < length:
            raise ValueError("tokenizer produced too few tokens")
        out.append(ids[:length])
    return out


def decode_steps(engine: Any, batch: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    """Seconds of each step in which every conversation decoded, and each one's tokens."""
    from bench.mesh_method import reset_prefix_cache
    from services.inference.sampling import SamplingParams

    reset_prefix_cache(engine)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(batch):
        engine.add_request(f"c{i}", list(ids), params)
    tokens: dict[str, list[int]] = {f"c{i}": [] for i in range(len(batch))}
    steps: list[float] = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - started
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        if len(outputs) == len(batch) and all(len(o.new_token_ids) == 1 for o in outputs):
            steps.append(elapsed)
    return steps, [tokens[f"c{i}"] for i in range(len(batch))]


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    from services.inference.config import EngineConfig
    from services.inference.engine import LLMEngine

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    slab_mib = EngineConfig.decode_slab_mib if args.slab_mib is None else args.slab_mib
    engines = {
        f"slab ({slab_mib} MiB)": LLMEngine(
            EngineConfig(model=args.model, device=args.device, dtype=args.dtype, decode_slab_mib=slab_mib)
        ),
        "gather (0 MiB)": LLMEngine(
            EngineConfig(model=args.model, device=args.device, dtype=args.dtype, decode_slab_mib=0)
        ),
    }
    batch = prompts(next(iter(engines.values())).tokenizer, args.rows, args.prompt_tokens)
    steps: dict[str, list[float]] = {name: [] for name in engines}
    answers: dict[str, list[list[int]]] = {}
    names = list(engines)
    for round_ in range(args.rounds):
        for name in names[round_ % 2 :] + names[: round_ % 2]:
            took, answers[name] = decode_steps(engines[name], batch, args.max_tokens)
            steps[name] += took
            print(f"round {round_ + 1} {name}: median decode step {1000 * statistics.median(took):.1f} ms")
    medians = {name: 1000 * statistics.median(s) for name, s in steps.items()}
    slab_name, gather_name = names
    identical = answers[slab_name] == answers[gather_name]
    results = {
        "workload": {"rows": args.rows, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens},
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_description(args.device),
        "device": args.device,
        "dtype": args.dtype,
        "rounds": args.rounds,
        "median_decode_step_ms": medians,
        "gather_over_slab": medians[gather_name] / medians[slab_name],
        "tokens_identical": identical,
        # Rows still allocated at the end: the slab held the batch (over budget it is freed).
        "slab_used": getattr(engines[slab_name].runner.slab, "rows", 0) > 0,
    }
    print(
        f"{args.rows} conversations of {args.prompt_tokens} tokens: decode step {medians[slab_name]:.1f} ms "
        f"with the slab, {medians[gather_name]:.1f} ms gathering ({results['gather_over_slab']:.2f}x); "
        f"tokens identical: {identical}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    # Both paths read the same K/V in the same order: different tokens would be a bug.
    return 0 if identical else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_slab", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
