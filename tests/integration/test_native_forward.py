"""The native Llama forward gives transformers' tokens whichever attention kernel runs.

SDPA's output memory layout depends on the kernel: CPU's flash kernel returns it one
way, the math kernel (and CUDA's kernels) another. The forward must not rely on
either: a single-row prefill under the math kernel once failed with a view error,
which is what every GPU replica hit on its first prompt.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from services.inference.engine import LLMEngine
from services.inference.sampling import SamplingParams
from tests.support.device import TEST_DEVICE, fp32_engine, reference_model

# The math kernel alone, and whatever SDPA picks by itself (on CPU its flash kernel, whose
# output is laid out the other way; on CUDA, for fp32 with grouped KV heads, math again).
KERNELS: dict[str, list[SDPBackend] | None] = {"math": [SDPBackend.MATH], "default": None}
PROMPTS = ["The history of painting begins with", "A robot who learns to paint starts by mixing"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def engine(model_path: Path) -> LLMEngine:
    return fp32_engine(model_path)


@pytest.fixture(scope="module")
def expected(model_path: Path, engine: LLMEngine) -> list[list[int]]:
    """transformers' own fp32 greedy tokens for each prompt alone."""
    model: Any = reference_model(model_path)
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = engine.tokenizer.encode(prompt)
            tokens = model.generate(
                torch.tensor([ids], device=model.device),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=-1,
            )
            out.append(tokens[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_prompt_and_a_padded_pair_match_transformers_under_each_sdpa_kernel(
    engine: LLMEngine, expected: list[list[int]], kernel: str
) -> None:
    assert engine.runner.model_impl == "native"
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert len(prompts[0]) != len(prompts[1]), "the pair must need padding"
    backends = KERNELS[kernel]
    with sdpa_kernel(backends) if backends is not None else contextlib.nullcontext():
        alone = engine.generate(prompts[:1], params)
        pair = engine.generate(prompts, params)
    assert alone == expected[:1]
    assert pair == expected


def test_the_forward_keeps_no_view_into_the_loaded_checkpoint(model_path: Path) -> None:
    # The loader's tensors can share storage mapped from the checkpoint file: one view kept by
    # the forward would keep the whole file resident (0.4 GiB of a 1.4 GiB replica, measured).
    from services.inference import llama
    from services.inference.model_loading import load_model

    model: Any = load_model(str(model_path), torch.device(TEST_DEVICE), torch.float32)
    loaded = {p.untyped_storage().data_ptr() for p in model.parameters()}
    forward = llama.LlamaForward(model, 256)
    kept = [forward.embed, forward.final_norm, forward.lm_head.weight]
    for layer in forward.layers:
        kept += [layer.input_norm, layer.post_attention_norm]
        kept += [linear.weight for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    shared = [t for t in kept if t is not None and t.untyped_storage().data_ptr() in loaded]
    assert shared == []


LONG = (
    "In the old harbour town the painters gathered every morning by the water, arguing about light, "
    "colour and the shapes of boats, while the fishermen mended their nets and laughed at them. "
    "One of them, a quiet engineer who had built machines all his life, decided to learn to paint"
)


def test_prompts_of_mixed_lengths_and_a_cached_prefix_attend_row_by_row_with_transformers_tokens(
    engine: LLMEngine, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Padding a four-word prompt to a long prompt's length would attend mostly padding: those steps attend
    # each row alone, over its own keys (the cached prefix included), and must change nothing.
    forward = engine.runner.native
    assert forward is not None
    by_row = forward._prefill_attention_by_row
    calls: list[int] = []
    monkeypatch.setattr(
        forward, "_prefill_attention_by_row", lambda *a: calls.append(len(a[3])) or by_row(*a)
    )
    tok = engine.tokenizer
    long, continued, short = (
        tok.encode(LONG),
        tok.encode(LONG + " the sea at dawn."),
        tok.encode("Hi there, my friend"),
    )
    model: Any = reference_model(model_path)

    def hf(ids: list[int]) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids], device=model.device),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=-1,
            )
        return out[0, len(ids) :].tolist()  # type: ignore[no-any-return]

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert engine.generate([long, short], params) == [hf(long), hf(short)]
    # `continued` starts with `long`'s blocks, now cached: its row sees keys before its first token.
    assert engine.generate([continued, short], params) == [hf(continued), hf(short)]
    assert calls and all(rows == 2 for rows in calls), calls


def test_prompts_from_one_template_attend_their_alike_tails_in_one_call_with_transformers_tokens(
    engine: LLMEngine, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One opening (computed once, by the first row), then each prompt's own tail of one length:
    # the tails attend in one call per run of alike rows, and must change nothing.
    from services.inference import llama

    runs: list[list[tuple[int, int, int, int, int]]] = []
    grouped = llama.same_shape_runs
    monkeypatch.setattr(llama, "same_shape_runs", lambda chunks: runs.append(grouped(chunks)) or runs[-1])
    tok = engine.tokenizer
    opening = LONG + " Then, one by one, the painters named their boats:"
    prompts = [tok.encode(f"{opening} {name}.") for name in ("Alba", "Brio", "Cora", "Dune")]
    assert len({len(p) for p in prompts}) == 1, "the tails must be alike for this test"
    model: Any = reference_model(model_path)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor(prompts, device=model.device),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=-1,
        )
    expected = [row[len(prompts[0]) :] for row in out.tolist()]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()  # the opening is computed in this step, by its first row
    assert engine.generate(prompts, params) == expected
    assert any(count >= 2 for step in runs for _, count, *_ in step), runs
