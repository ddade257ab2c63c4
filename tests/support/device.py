"""Where the tests' inference engines run: the CPU (CI has no GPU) unless LLMMESH_TEST_DEVICE names one.

``LLMMESH_TEST_DEVICE=cuda pytest tests/integration/test_inference_*.py`` runs the
engine's exactness tests on a GPU (``bench/gpu_check.sh`` does). They stay in fp32
there, so transformers' own fp32 ``generate`` on the same device is still the
ground truth, token for token. Tests of the router keep their replicas on the CPU.
"""

from __future__ import annotations

import os

TEST_DEVICE = os.environ.get("LLMMESH_TEST_DEVICE", "cpu")


def replica_device_args() -> list[str]:
    """Command-line arguments that put an inference replica on the test device, in fp32."""
    return ["--device", TEST_DEVICE, "--dtype", "float32"]
