"""Which models take the native forward: exact Llama-family decoders only, the rest go through transformers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from services.inference import llama


def model(**config: Any) -> SimpleNamespace:
    base = {"model_type": "llama", "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
    base.update(config)
    return SimpleNamespace(config=SimpleNamespace(**base), model=SimpleNamespace(rotary_emb=object()))


def test_a_plain_llama_takes_the_native_forward() -> None:
    assert llama.supports(model(rope_parameters={"rope_type": "default", "rope_theta": 1e5}))
    assert llama.supports(model(rope_parameters={"rope_type": "llama3"}))


def test_variants_the_native_forward_would_get_wrong_fall_back() -> None:
    assert not llama.supports(model(model_type="qwen2"))  # q/k/v biases
    assert not llama.supports(model(attention_bias=True))
    assert not llama.supports(model(mlp_bias=True))
    assert not llama.supports(model(hidden_act="gelu"))
    assert not llama.supports(model(rope_scaling={"type": "dynamic"}))  # frequencies change with length
    assert not llama.supports(model(rope_parameters={"rope_type": "longrope"}))
