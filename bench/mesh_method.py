"""The llm-mesh engine as a benchmark method: driven in-process through add_request / step."""

from __future__ import annotations

import time
from typing import Any

from bench.timings import MethodRun, RequestTiming
from bench.workloads import Workload


def build_engine(
    model: str,
    dtype: str,
    device: str,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int | None,
    compile_model: bool,
    model_impl: str = "auto",
) -> Any:
    """An `LLMEngine` with the benchmark's batch limits (imported here: it loads torch)."""
    from services.inference.config import EngineConfig
    from services.inference.engine import LLMEngine

    options: dict[str, Any] = {
        "model": model,
        "dtype": dtype,
        "device": device,
        "max_num_seqs": max_num_seqs,
        "compile": compile_model,
        "model_impl": model_impl,
    }
    if max_num_batched_tokens is not None:
        options["max_num_batched_tokens"] = max_num_batched_tokens
    return LLMEngine(EngineConfig(**options))


def reset_prefix_cache(engine: Any) -> None:
    """Forget prompts cached by earlier rounds, so every round prefills what it would cold.

    Prefix sharing within a round is fair (transformers' continuous batching shares too,
    and its manager is rebuilt per run); reuse across repeated rounds is not. Uses the
    engine's own `reset_prefix_cache()` when it has one; otherwise swaps in a fresh,
    empty block manager of the same size, which is valid only while the engine is idle.
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("cannot reset the prefix cache while requests are running")
    reset = getattr(engine, "reset_prefix_cache", None)
    if callable(reset):
        reset()
        return
    from services.inference.block_manager import BlockManager

    old = engine.block_manager
    fresh = BlockManager(old.num_blocks, old.block_size)
    engine.block_manager = fresh
    engine.scheduler.block_manager = fresh


def run_llm_mesh(engine: Any, workload: Workload) -> MethodRun:
    """Feed requests at their arrival times and step the engine until all finish.

    A request's first token and finish are stamped when the step that produced them
    returns, i.e. when a server would hand them to its client.
    """
    from services.inference.sampling import SamplingParams

    reset_prefix_cache(engine)
    pending = list(workload.requests)
    timings: dict[str, RequestTiming] = {}
    finished = 0
    t0 = time.perf_counter()
    while finished < len(workload.requests):
        now = time.perf_counter()
        while pending and t0 + pending[0].arrival_s <= now:
            req = pending.pop(0)
            timings[req.request_id] = RequestTiming(req.request_id, arrival=t0 + req.arrival_s)
            engine.add_request(
                req.request_id,
                list(req.prompt_token_ids),
                SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True),
            )
        if not engine.has_unfinished_requests():
            if not pending:
                raise RuntimeError("llm_mesh engine went idle with requests unfinished")
            time.sleep(max(0.0, t0 + pending[0].arrival_s - time.perf_counter()))
            continue
        outputs = engine.step()
        stamp = time.perf_counter()
        for out in outputs:
            timing = timings[out.request_id]
            if out.new_token_ids:
                if timing.first_token is None:
                    timing.first_token = stamp
                timing.token_ids.extend(out.new_token_ids)
            if out.finished:
                timing.finish = stamp
                finished += 1
    return MethodRun("llm_mesh", timings)
