"""The router's settings refuse values a request could never send."""

from __future__ import annotations

import math

import pytest

from services.router.runtime import RouterSettings


@pytest.mark.parametrize("threshold", [0.0, -0.5, -1.0, 1.5, math.nan])
def test_a_semantic_threshold_outside_0_to_1_is_refused_as_a_requests_own_is(threshold: float) -> None:
    """[-1, 1] was taken: at 0 or below every stored question of the tenant became a candidate,
    while a request's own cache.semantic_threshold must be in (0, 1]."""
    with pytest.raises(ValueError, match=r"--semantic-cache-threshold must be in \(0, 1\]"):
        RouterSettings(replicas=("127.0.0.1:9",), semantic_cache_threshold=threshold)


def test_a_semantic_threshold_in_0_to_1_is_taken() -> None:
    assert (
        RouterSettings(replicas=("127.0.0.1:9",), semantic_cache_threshold=1.0).semantic_cache_threshold
        == 1.0
    )
