"""Where the tests' inference engines run: the CPU (CI has no GPU) unless LLMMESH_TEST_DEVICE names one.

``LLMMESH_TEST_DEVICE=cuda pytest tests/integration/test_inference_*.py`` runs the
engine's exactness tests on a GPU (``bench/gpu_check.sh`` does). They stay in fp32
there, so transformers' own fp32 ``generate`` on the same device is still the
ground truth, token for token. Tests of the router keep their replicas on the CPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the router's tests import this module too: torch only where a helper runs
    from services.inference.engine import LLMEngine

TEST_DEVICE = os.environ.get("LLMMESH_TEST_DEVICE", "cpu")


def replica_device_args() -> list[str]:
    """Command-line arguments that put an inference replica on the test device, in fp32."""
    return ["--device", TEST_DEVICE, "--dtype", "float32"]


def reference_model(model_path: Path) -> Any:
    """transformers' own fp32 model on the test device, in eval mode: the ground truth the
    engine's tokens and logprobs are compared with."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).to(TEST_DEVICE).eval()


def fp32_engine(model_path: Path, **config: Any) -> LLMEngine:
    """An fp32 engine on the test device (64 KV blocks unless ``config`` says otherwise)."""
    from services.inference.config import EngineConfig
    from services.inference.engine import LLMEngine

    settings: dict[str, Any] = {"num_kv_blocks": 64, **config}
    return LLMEngine(EngineConfig(model=str(model_path), dtype="float32", device=TEST_DEVICE, **settings))
