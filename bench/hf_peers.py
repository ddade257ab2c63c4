"""The Hugging Face peers the engine is measured against: naive, static batching, continuous batching.

All three are greedy with EOS ignored (``eos_token_id=-1`` never matches), so every method
produces exactly the tokens it was asked for and the token streams can be compared.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from bench.timings import MethodRun, RequestTiming
from bench.workloads import BenchRequest, Workload

# transformers' continuous batching on CPU exactly as BENCHMARKS.md configured the peer:
# with defaults on CPU it sizes its KV cache from 60 % of free RAM. On a GPU the bench
# leaves both to transformers, which sizes them from free GPU memory.
CB_NUM_BLOCKS = 64
CB_MAX_BATCH_TOKENS = 2048


class StepClock(StoppingCriteria):
    """Records when each generation step's tokens exist; never stops anything.

    `generate` calls stopping criteria once per new token, after it is appended, so
    ``times[k]`` is when token k (0-based) of every row in the batch became available.
    """

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


def greedy_config(max_new_tokens: int, pad_token_id: int) -> GenerationConfig:
    """Greedy, exactly `max_new_tokens` tokens: EOS id -1 never matches, so EOS is ignored, not masked."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


@torch.inference_mode()
def run_naive(
    model: Any,
    workload: Workload,
    pad_token_id: int,
    sample: int | None = None,
    log: Callable[[str], None] = print,
) -> MethodRun:
    """`model.generate` one request at a time, first come first served.

    With `sample` < len(requests), only that many requests (spread evenly over the
    workload) are generated; the rest are simulated as a FIFO queue from the measured
    per-token prefill and decode times, and the run says so.
    """
    requests = workload.requests
    chosen = requests
    if sample is not None and 0 < sample < len(requests):
        stride = len(requests) / sample
        chosen = [requests[int(k * stride)] for k in range(sample)]
    measured: dict[str, tuple[float, float]] = {}  # request_id -> (prefill_s, decode_s_per_token)
    timings: dict[str, RequestTiming] = {}
    simulated = len(chosen) < len(requests)
    t0 = time.perf_counter()
    for req in chosen:
        if not simulated:
            _sleep_until(t0 + req.arrival_s)
        start = time.perf_counter()
        clock = StepClock()
        ids = torch.tensor([req.prompt_token_ids], dtype=torch.long, device=model.device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=greedy_config(req.max_tokens, pad_token_id),
            stopping_criteria=StoppingCriteriaList([clock]),
        )
        prefill = clock.times[0] - start
        decode = (clock.times[-1] - clock.times[0]) / max(1, len(clock.times) - 1)
        measured[req.request_id] = (prefill, decode)
        timings[req.request_id] = RequestTiming(
            req.request_id,
            arrival=t0 + req.arrival_s,
            first_token=clock.times[0],
            finish=clock.times[-1],
            token_ids=out[0, ids.shape[1] :].tolist(),
        )
    if not simulated:
        return MethodRun("naive", timings)
    log(f"naive: timed {len(chosen)} of {len(requests)} requests; the rest are simulated")
    return MethodRun(
        "naive",
        _simulate_fifo(requests, measured, timings),
        note=(
            f"naive timed {len(chosen)} of {len(requests)} requests one at a time; tok/s, TTFT and latency "
            "are extrapolated from a FIFO queue over the measured per-request prefill and per-token decode times"
        ),
        simulated=frozenset(r.request_id for r in requests) - frozenset(measured),
    )


def _simulate_fifo(
    requests: list[BenchRequest],
    measured: dict[str, tuple[float, float]],
    timed: dict[str, RequestTiming],
) -> dict[str, RequestTiming]:
    """One server, FIFO: each request waits for the previous one, then takes mean prefill + its decode."""
    mean_prefill = sum(p for p, _ in measured.values()) / len(measured)
    mean_decode = sum(d for _, d in measured.values()) / len(measured)
    timings: dict[str, RequestTiming] = {}
    free_at = 0.0
    for req in requests:
        start = max(free_at, req.arrival_s)
        first = start + mean_prefill
        finish = first + mean_decode * (req.max_tokens - 1)
        free_at = finish
        tokens = timed[req.request_id].token_ids if req.request_id in timed else [-1] * req.max_tokens
        timings[req.request_id] = RequestTiming(
            req.request_id, arrival=req.arrival_s, first_token=first, finish=finish, token_ids=tokens
        )
    return timings


@torch.inference_mode()
def run_static(model: Any, workload: Workload, pad_token_id: int, max_batch: int = 64) -> MethodRun:
    """HF `generate` on left-padded batches, formed in waves.

    Whenever the model is idle it takes every request that has arrived (up to
    `max_batch`) as one batch and generates the wave's largest `max_tokens` for all of
    them; if nothing has arrived it waits for the next arrival. A request's first token
    and finish are credited at the step that produced them (as if streamed), which
    flatters static batching: a real static server answers when the whole batch ends.
    """
    pending = list(workload.requests)
    timings: dict[str, RequestTiming] = {}
    waves = 0
    t0 = time.perf_counter()
    while pending:
        now = time.perf_counter() - t0
        wave = [r for r in pending if r.arrival_s <= now][:max_batch]
        if not wave:
            _sleep_until(t0 + pending[0].arrival_s)
            continue
        taken = {r.request_id for r in wave}
        pending = [r for r in pending if r.request_id not in taken]
        waves += 1
        width = max(len(r.prompt_token_ids) for r in wave)
        ids = torch.full((len(wave), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(wave), width), dtype=torch.long)
        for row, req in enumerate(wave):
            n = len(req.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(req.prompt_token_ids, dtype=torch.long)
            mask[row, width - n :] = 1
        clock = StepClock()
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            generation_config=greedy_config(max(r.max_tokens for r in wave), pad_token_id),
            stopping_criteria=StoppingCriteriaList([clock]),
        )
        for row, req in enumerate(wave):
            timings[req.request_id] = RequestTiming(
                req.request_id,
                arrival=t0 + req.arrival_s,
                first_token=clock.times[0],
                finish=clock.times[req.max_tokens - 1],
                token_ids=out[row, width : width + req.max_tokens].tolist(),
            )
    note = "" if waves == 1 else f"hf_static ran {waves} waves of up to {max_batch} arrived requests"
    return MethodRun("hf_static", timings, note=note)


@torch.inference_mode()
def run_continuous(
    model: Any,
    workload: Workload,
    pad_token_id: int,
    page_size: int = 256,
    num_blocks: int | None = CB_NUM_BLOCKS,
    max_batch_tokens: int | None = CB_MAX_BATCH_TOKENS,
) -> MethodRun:
    """transformers' built-in continuous batching (`init_continuous_batching`); None sizes are its own.

    Its manager is built and warmed up before the clock starts; requests are added at
    their arrival times and timed by the manager's own per-token timestamps.
    """
    requests = workload.requests
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
        max_generated_length=max(r.max_tokens for r in requests),
        num_requests=len(requests),
    )
    cb_config = ContinuousBatchingConfig(
        num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, page_size=page_size
    )
    manager = model.init_continuous_batching(
        generation_config=greedy_config(hints.max_generated_length, pad_token_id),
        continuous_batching_config=cb_config,
        workload_hints=hints,
    )
    # The manager logs every request it drops or sorts at INFO/WARNING; keep the table readable.
    logging.getLogger("transformers.generation.continuous_batching").setLevel(logging.ERROR)
    manager.warmup()
    manager.start()
    timings: dict[str, RequestTiming] = {}
    try:
        pending = list(requests)
        t0 = time.perf_counter()
        while len(timings) < len(requests):
            now = time.perf_counter()
            while pending and t0 + pending[0].arrival_s <= now:
                req = pending.pop(0)
                manager.add_request(
                    input_ids=req.prompt_token_ids,
                    request_id=req.request_id,
                    max_new_tokens=req.max_tokens,
                    record_timestamps=True,
                    eos_token_id=-1,
                )
            wait = (t0 + pending[0].arrival_s - now) if pending else 1.0
            result = manager.get_result(timeout=max(0.001, wait))
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(
                        "transformers continuous batching stopped before finishing the workload"
                    )
                continue
            if not result.is_finished():
                continue
            if result.error is not None:
                raise RuntimeError(
                    f"transformers continuous batching failed {result.request_id}: {result.error}"
                )
            stamps = result.timestamps or [time.perf_counter()]
            arrival = t0 + next(r.arrival_s for r in requests if r.request_id == result.request_id)
            timings[result.request_id] = RequestTiming(
                result.request_id,
                arrival=arrival,
                first_token=stamps[0],
                finish=stamps[-1],
                token_ids=list(result.generated_tokens),
            )
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    return MethodRun("hf_continuous", timings)
