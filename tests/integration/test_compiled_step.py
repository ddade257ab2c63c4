"""``--compile`` on the native forward: compiled at start-up, and fp32 greedy tokens stay transformers'.

The other engine tests run eager; this one builds an engine with the compiled
layer kernels (compiled_step.py) and decodes prompts of different lengths
together, so steps mix prefill chunks and decode rows of several row counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.inference import layer_kernels
from services.inference.config import EngineConfig
from services.inference.engine import LLMEngine
from services.inference.sampling import SamplingParams
from tests.support.device import TEST_DEVICE, reference_model

PROMPTS = [
    "The history of painting begins with",
    "A robot who learns to paint starts by mixing",
    "Three facts about the moon:",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(model_path: Path) -> LLMEngine:
    config = EngineConfig(
        model=str(model_path), dtype="float32", device=TEST_DEVICE, num_kv_blocks=64, compile=True
    )
    return LLMEngine(config)


def _transformers_tokens(model_path: Path, prompts: list[list[int]]) -> list[list[int]]:
    model: Any = reference_model(model_path)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            tokens = model.generate(
                torch.tensor([ids], device=model.device),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=-1,
            )
            out.append(tokens[0, len(ids) :].tolist())
    return out


@pytest.mark.full
def test_compiled_engine_gives_transformers_fp32_greedy_tokens_without_compiling_on_a_request(
    engine: LLMEngine, model_path: Path
) -> None:
    from torch._dynamo.utils import counters

    native = engine.runner.native
    assert native is not None and native.kernels is not layer_kernels.EAGER
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    graphs_at_start = counters["stats"]["unique_graphs"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got = engine.generate(prompts, params)
    # Every shape was compiled at start-up: requests never wait on inductor.
    assert counters["stats"]["unique_graphs"] == graphs_at_start
    assert got == _transformers_tokens(model_path, prompts)


@pytest.mark.full
def test_a_lone_request_decodes_through_the_padded_graph_with_transformers_fp32_tokens(
    engine: LLMEngine, model_path: Path
) -> None:
    from torch._dynamo.utils import counters

    native = engine.runner.native
    assert native is not None and native.decode_graph is not None
    graph = native.decode_graph
    buckets = set(graph.buckets)
    calls = 0
    inner = graph.graph

    def counted(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return inner(*args)

    # Whatever the warm-up's timing chose for one row, this request's decode steps take the graph.
    graph.buckets = buckets | {1}
    graph.graph = counted
    graphs_at_start = counters["stats"]["unique_graphs"]
    try:
        prompt = engine.tokenizer.encode(PROMPTS[1])
        got = engine.generate(
            [prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        )
    finally:
        graph.buckets, graph.graph = buckets, inner
    assert calls == MAX_TOKENS - 1  # every step after the prefill, each one row padded to two
    assert counters["stats"]["unique_graphs"] == graphs_at_start
    assert got == _transformers_tokens(model_path, [prompt])
