"""Prompt logprobs: every prompt token scored by the model, as an evaluation harness reads them.

fp32 on the real model, against transformers' own forward over the same ids: each prompt
token's log probability is ``log_softmax`` of the logits at the position before it. The
prompt is longer than the step's token budget, so it is scored across chunked prefill steps,
beside a request that asked for nothing and keeps its tokens.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common import errors
from services.inference.config import EngineConfig
from services.inference.engine import LLMEngine, RequestOutput
from services.inference.sampling import SamplingParams
from tests.support.device import TEST_DEVICE, reference_model

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil "
    "and a cloth for the great lens, and from the gallery he watched the fishing boats come home "
    "one by one across the darkening water of the bay."
)
TOP = 3


@pytest.fixture(scope="module")
def engine(model_path: Path) -> LLMEngine:
    # A 16-token step budget: the prompt is prefilled (and scored) over several steps.
    return LLMEngine(
        EngineConfig(
            model=str(model_path),
            dtype="float32",
            device=TEST_DEVICE,
            num_kv_blocks=64,
            max_num_batched_tokens=16,
        )
    )


@pytest.fixture(scope="module")
def reference(model_path: Path, engine: LLMEngine) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and transformers' log-softmaxed logits at every position: [len, vocab]."""
    ids = engine.tokenizer.encode(TEXT)
    model: Any = reference_model(model_path)
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1).cpu()


def run(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def test_every_prompt_token_is_scored_as_transformers_scores_it_across_chunked_prefill(
    engine: LLMEngine, reference: tuple[list[int], torch.Tensor]
) -> None:
    ids, logprobs = reference
    assert len(ids) > 2 * engine.config.max_num_batched_tokens, "the prompt must span prefill steps"
    scored = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    alone = run(engine, {"plain-alone": (ids, plain)})["plain-alone"]
    outputs = run(engine, {"scored": (ids, scored), "plain": (ids, plain)})
    first, *rest = outputs["scored"]
    prompt = first.prompt_logprobs
    assert [t.token for t in prompt] == ids
    assert math.isnan(prompt[0].logprob) and prompt[0].top == ()
    for position in range(1, len(ids)):
        expected = logprobs[position - 1]
        got = prompt[position]
        assert got.logprob == pytest.approx(float(expected[ids[position]]), abs=1e-4), position
        values, top_ids = torch.topk(expected, TOP)
        assert [i for i, _ in got.top] == top_ids.tolist(), position
        assert [v for _, v in got.top] == pytest.approx(values.tolist(), abs=1e-4)
    # Handed out once, with the first token; the answer is the one the request gets without them.
    assert all(not out.prompt_logprobs for out in rest)
    tokens = [t for out in outputs["scored"] for t in out.new_token_ids]
    assert tokens == [t for out in alone for t in out.new_token_ids]
    assert [t for out in outputs["plain"] for t in out.new_token_ids] == tokens
    assert all(not out.prompt_logprobs for out in outputs["plain"])


def test_a_scored_prompt_reuses_no_cached_prefix_and_a_plain_one_still_does(
    engine: LLMEngine, reference: tuple[list[int], torch.Tensor]
) -> None:
    ids, _ = reference
    plain = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    run(engine, {"warm": (ids, plain)})  # the prompt's blocks are now cached
    outputs = run(engine, {"scored-again": (ids, scored)})["scored-again"]
    assert outputs[-1].usage is not None and outputs[-1].usage.cached_prompt_tokens == 0
    assert len(outputs[0].prompt_logprobs) == len(ids)
    assert all(t.top == () for t in outputs[0].prompt_logprobs)
    reused = run(engine, {"plain-again": (ids, plain)})["plain-again"]
    assert reused[-1].usage is not None and reused[-1].usage.cached_prompt_tokens > 0


def test_prompt_logprobs_out_of_range_name_the_field() -> None:
    with pytest.raises(errors.InvalidArgument) as refused:
        SamplingParams(prompt_logprobs=21)
    assert refused.value.field == "prompt_logprobs"
