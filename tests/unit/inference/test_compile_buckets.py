"""--compile on CPU: a row bucket runs the compiled kernel only where warm-up measured it faster."""

from __future__ import annotations

import torch

from services.inference.compiled_step import _Bucketed, faster_buckets, row_bucket


def test_row_counts_fall_in_the_power_of_two_at_or_above_them() -> None:
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 64, 65, 2048)] == [1, 2, 4, 4, 8, 64, 128, 2048]


def test_only_buckets_where_compiled_won_by_the_margin_use_it() -> None:
    # (eager seconds, compiled seconds) per bucket
    timings = {1: (1.0, 2.0), 64: (1.0, 0.97), 512: (1.0, 0.5), 2048: (1.0, 0.94)}
    assert faster_buckets(timings, min_gain=0.05) == {512, 2048}


def test_a_calibrated_kernel_calls_eager_outside_its_buckets() -> None:
    calls: list[str] = []

    def eager(x: torch.Tensor) -> str:
        calls.append("eager")
        return "eager"

    def compiled(x: torch.Tensor) -> str:
        calls.append("compiled")
        return "compiled"

    kernel = _Bucketed(compiled, eager)
    kernel.buckets = {512}
    assert [kernel(torch.zeros(n, 1)) for n in (1, 64, 300, 512, 513)] == [
        "eager",
        "eager",
        "compiled",  # 300 rows fall in the 512 bucket
        "compiled",
        "eager",
    ]
    uncalibrated = _Bucketed(compiled, eager)  # CUDA and before calibration: every row count compiled
    assert uncalibrated(torch.zeros(7, 1)) == "compiled"
