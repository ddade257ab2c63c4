"""A GGUF file loads directly (dequantized by transformers) and runs on the native forward."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.inference.config import EngineConfig
from services.inference.engine import LLMEngine
from services.inference.fetch_model import GGUF_NAME
from services.inference.sampling import SamplingParams
from tests.support.device import TEST_DEVICE

pytestmark = pytest.mark.timeout(600)


def test_the_gguf_file_generates_what_its_converted_checkpoint_does(model_path: Path) -> None:
    gguf = model_path.parent / "gguf" / GGUF_NAME
    if not gguf.exists():
        pytest.fail(f"{gguf} missing: run `make setup` (it keeps the GGUF)")
    from_gguf = LLMEngine(
        EngineConfig(model=str(gguf), dtype="float32", device=TEST_DEVICE, num_kv_blocks=32)
    )
    assert from_gguf.runner.model_impl == "native"
    assert from_gguf.model_id == gguf.stem
    prompts = [
        from_gguf.tokenizer.encode("The capital of France is"),
        from_gguf.tokenizer.encode("A robot who learns to paint starts with"),
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = from_gguf.generate(prompts, params)
    del from_gguf
    converted = LLMEngine(
        EngineConfig(model=str(model_path), dtype="float32", device=TEST_DEVICE, num_kv_blocks=32)
    )
    assert got == converted.generate(prompts, params)
    assert all(len(tokens) == 12 for tokens in got)
