"""Where an llm-mesh engine step spends its time: schedule, host-side batch prep, forward, LM head, sampling, update.

    python -m bench.engine_profile --num-requests 64 --max-tokens 32 [--dtype bfloat16] [--compile]
    python -m bench.engine_profile --device cuda --dtype bfloat16   # on a GPU

Times each phase of every step of the `uniform` workload (wrapping the engine's own
methods; nothing is replaced), then runs torch.profiler over a few full-batch decode
steps and prints the heaviest operators. On CUDA each phase waits for the GPU before
its clock stops (so a phase owns its kernels' time, not just their launches), and the
profiler records GPU time too: a step much longer than its GPU time is host-bound.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

PHASES = ("schedule", "prep", "forward", "lm_head", "sample", "update")


class PhaseClock:
    """Accumulates wall time per phase, separately for steps with and without prefill."""

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        self.sync = sync  # waits for the device, so its queued work counts in the phase that queued it
        self.current: dict[str, float] = defaultdict(float)
        self.totals: dict[str, dict[str, float]] = {
            "decode": defaultdict(float),
            "prefill": defaultdict(float),
        }
        self.steps = {"decode": 0, "prefill": 0}

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.current[phase] += time.perf_counter() - start

        return timed

    def close_step(self, kind: str, total: float) -> None:
        inner = self.current
        execute = inner.pop("execute", 0.0)
        # Execute's remainder is Python building index/mask tensors and stacking rows.
        inner["prep"] = (
            execute - inner.get("forward", 0.0) - inner.get("lm_head", 0.0) - inner.get("sample", 0.0)
        )
        inner["update"] = total - execute - inner.get("schedule", 0.0)
        for phase in PHASES:
            self.totals[kind][phase] += inner.get(phase, 0.0)
        self.steps[kind] += 1
        self.current = defaultdict(float)


def instrument(engine: Any, clock: PhaseClock) -> None:
    """Wrap the engine's scheduler, runner and sampler calls with the phase clock."""
    runner = engine.runner
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    runner.execute = clock.wrap("execute", runner.execute)
    runner.sampler = clock.wrap("sample", runner.sampler)
    if runner.native is not None:
        runner.native.hidden_states = clock.wrap("forward", runner.native.hidden_states)
        runner.native.logits = clock.wrap("lm_head", runner.native.logits)
        return
    runner._forward = clock.wrap("forward", runner._forward)
    head = runner.lm_head
    started: list[float] = []
    head.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
    head.register_forward_hook(
        lambda *_: clock.current.__setitem__("lm_head", time.perf_counter() - started.pop())
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine_profile", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--model-impl", choices=("auto", "native", "transformers"), default="auto")
    parser.add_argument("--trace-steps", type=int, default=5, help="decode steps under torch.profiler")
    parser.add_argument(
        "--trace-after",
        type=int,
        default=10,
        help="full-batch decode steps to run before tracing: the first ones allocate the decode "
        "slab and fault in fresh KV-cache pages, which a long-running replica has paid already",
    )
    parser.add_argument("--top", type=int, default=15, help="operators to list")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from bench import mesh_method, workloads
    from services.inference.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    engine = mesh_method.build_engine(
        args.model,
        args.dtype,
        args.device,
        max_num_seqs=64,
        max_num_batched_tokens=None,
        compile_model=args.compile,
        model_impl=args.model_impl,
    )
    work = workloads.uniform(engine.tokenizer, args.num_requests, args.max_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([r.prompt_token_ids for r in work.requests[:2]], params)  # warm-up, off the clock

    on_gpu = args.device == "cuda"
    clock = PhaseClock(torch.cuda.synchronize if on_gpu else lambda: None)
    instrument(engine, clock)
    mesh_method.reset_prefix_cache(engine)
    for req in work.requests:
        engine.add_request(req.request_id, list(req.prompt_token_ids), params)
    tokens = 0
    traced = False
    full_decode_steps = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        prefilling = any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
        ) or bool(engine.scheduler.waiting)
        full_decode = not prefilling and len(engine.scheduler.running) == len(work.requests)
        full_decode_steps += int(full_decode)
        if full_decode and not traced and args.trace_steps > 0 and full_decode_steps > args.trace_after:
            traced = True
            activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
            with profile(activities=activities) as prof:
                for _ in range(args.trace_steps):
                    tokens += sum(len(o.new_token_ids) for o in engine.step())
            clock.current.clear()
            print(f"\ntorch.profiler over {args.trace_steps} decode steps at batch {len(work.requests)}:")
            sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=sort, row_limit=args.top))
            continue
        step_start = time.perf_counter()
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        clock.close_step("prefill" if prefilling else "decode", time.perf_counter() - step_start)
    elapsed = time.perf_counter() - started
    print(f"{tokens} tokens in {elapsed:.1f}s ({tokens / elapsed:.1f} tok/s incl. profiler overhead)")
    for kind, phases in clock.totals.items():
        steps = clock.steps[kind]
        if not steps:
            continue
        total = sum(phases.values())
        print(f"\n{kind} steps: {steps}, {1000 * total / steps:.1f} ms/step")
        for phase in PHASES:
            share = phases[phase] / total if total else 0.0
            print(f"  {phase:9s} {1000 * phases[phase] / steps:8.2f} ms/step  {100 * share:5.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
