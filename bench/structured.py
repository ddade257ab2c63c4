"""The engine benchmark's ``structured`` workload (``python -m bench.engine --workload structured``).

Three runs of the same prompts, fp32 greedy, in one process:

- ``free``: the requests unconstrained, all at once through llm-mesh's engine;
- ``json``: the same requests, each with its own JSON schema (compiled as the async front
  compiles them, off the step loop: the compile times are reported, p50/p95), all at once;
- ``hf_json``: the same constrained requests through transformers' ``generate`` (one static
  batch) with a logits processor over the same library (llguidance) and the same mask code.

It prints tokens/s of each and the ratios json/free (goal ≥ 0.85) and json/hf_json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

#: The schema every request gets a variant of (a distinct title per request, so each compiles).
BASE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
PROMPT = "Describe character number {i} of a story as JSON with name, age, city and tags."


def schema_for(i: int) -> str:
    return json.dumps({**BASE_SCHEMA, "title": f"character-{i}"})


def run(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from bench import mesh_method
    from bench.workloads import chat_prompt_ids

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    n = args.num_requests or 64
    max_tokens = args.max_tokens or 64
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    prompts = [chat_prompt_ids(tokenizer, PROMPT.format(i=i)) for i in range(n)]
    device = "cpu" if args.device == "auto" and not torch.cuda.is_available() else args.device
    device = "cuda" if device == "auto" else device
    engine = mesh_method.build_engine(
        args.model,
        args.dtype,
        device,
        max_num_seqs=max(args.max_num_seqs, n),
        max_num_batched_tokens=args.max_num_batched_tokens,
        compile_model=args.compile,
        model_impl=args.model_impl,
    )
    # Off the clock: the whole batch once (first steps allocate), and llguidance's view of the
    # vocabulary (built once per replica, ~1 s, not a compile).
    _mesh_run(engine, prompts, 4, None)
    started = time.perf_counter()
    engine.grammars.tokenizer  # noqa: B018 - built on first use
    tokenizer_s = time.perf_counter() - started
    free = _mesh_run(engine, prompts, max_tokens, None)
    constrained = _mesh_run(engine, prompts, max_tokens, [schema_for(i) for i in range(n)])
    compile_ms = sorted(constrained.pop("compile_ms"))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    hf = _hf_run(hf_model.to(device).eval(), engine, tokenizer, prompts, max_tokens)
    document: dict[str, Any] = {
        "workload": "structured",
        "num_requests": n,
        "max_tokens": max_tokens,
        "results": {"free": free, "json": constrained, "hf_json": hf},
        "compile_ms": {"p50": _pct(compile_ms, 0.5), "p95": _pct(compile_ms, 0.95), "count": len(compile_ms)},
        "grammar_tokenizer_s": tokenizer_s,
        "ratios": {
            "json/free": constrained["tok_s"] / free["tok_s"],
            "json/hf_json": constrained["tok_s"] / hf["tok_s"],
        },
    }
    for name, result in document["results"].items():
        print(
            f"{name:8s} {result['tokens']:6d} tokens in {result['seconds']:7.2f}s: {result['tok_s']:8.1f} tok/s"
        )
    print(
        f"grammar compile: p50 {document['compile_ms']['p50']:.2f} ms, p95 {document['compile_ms']['p95']:.2f} ms"
        f" ({len(compile_ms)} schemas; the tokenizer view, once: {tokenizer_s:.2f} s)"
    )
    for name, ratio in document["ratios"].items():
        print(f"{name}: {ratio:.2f}x")
    if args.json is not None:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return 0


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def _mesh_run(
    engine: Any, prompts: list[list[int]], max_tokens: int, schemas: list[str] | None
) -> dict[str, Any]:
    from services.inference.sampling import Constraint, ConstraintKind, SamplingParams

    compile_ms: list[float] = []
    queued: list[tuple[str, list[int], SamplingParams, Any]] = []
    for i, prompt in enumerate(prompts):
        constraint = None if schemas is None else Constraint(ConstraintKind.JSON_SCHEMA, schemas[i])
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, constraint=constraint)
        started = time.perf_counter()
        guide = engine.make_guide(params)  # the async front does this on an executor thread
        compile_ms.append((time.perf_counter() - started) * 1000.0)
        queued.append((f"s{i}-{time.monotonic_ns()}", prompt, params, guide))
    started = time.perf_counter()
    for rid, prompt, params, guide in queued:
        engine.admit(prompt, params)
        engine.enqueue(rid, list(prompt), params, (), guide)
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - started
    result: dict[str, Any] = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
    if schemas is not None:
        result["compile_ms"] = compile_ms
    return result


def _hf_run(
    model: Any, engine: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from services.inference.sampler import apply_guides
    from services.inference.sampling import Constraint, ConstraintKind

    guides = [
        engine.grammars.guide(Constraint(ConstraintKind.JSON_SCHEMA, schema_for(i)))
        for i in range(len(prompts))
    ]

    class GuidedLogits(LogitsProcessor):  # type: ignore[misc]
        """The same llguidance matchers and mask code as the engine, in transformers' loop."""

        def __init__(self) -> None:
            self.steps = 0

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.steps:
                for guide, token in zip(guides, input_ids[:, -1].tolist(), strict=True):
                    guide.advance(token)
            self.steps += 1
            apply_guides(scores, guides)
            return scores

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([GuidedLogits()]),
            pad_token_id=pad,
        )
    seconds = time.perf_counter() - started
    eos = tokenizer.eos_token_id
    tokens = 0
    for row in out[:, width:].tolist():
        tokens += next((k + 1 for k, t in enumerate(row) if t == eos), len(row))
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
