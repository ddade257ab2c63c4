"""A long prompt gets the time its prefill takes before its first token, a short one does not:
the TTFT timeout grows with the prompt by the replica's learned prefill cost."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.common.generate_many.client import ReplicaMultiplexer
from services.gen.llmmesh.v1 import common_pb2, inference_pb2
from services.router.placement.policies import LeastOutstandingPolicy
from services.router.placement.pool import ReplicaPool
from services.router.placement.request import PlacementRequest
from services.router.streams.relay import (
    Relay,
    RelayConfig,
    RelayOutcome,
    estimated_prompt_tokens,
    ttft_limit,
)
from tests.support.processes import ServiceProcess
from tests.support.router_mesh import synthetic_replica

FIRST_TOKEN_S = 1.5  # the replica's time to a first token, whatever the prompt


@pytest.fixture(scope="module")
def slow_prefill() -> Iterator[ServiceProcess]:
    process = synthetic_replica("--ttft-ms", str(int(FIRST_TOKEN_S * 1000))).start()
    yield process
    process.stop()


async def first_tokens(replica: ServiceProcess, text: str, prefill_s_per_token: float | None) -> int:
    """Tokens the relay got for a prompt of ``text``, its TTFT timeout 0.5 s before the prompt's share."""
    pool = ReplicaPool(ReplicaMultiplexer)
    pool.set_addresses([replica.address])
    (only,) = pool.replicas.values()
    only.model, only.serving = "synthetic", True
    if prefill_s_per_token is not None:
        only.costs.prefill_per_token.observe(prefill_s_per_token)  # as its finished answers taught it
    relay = Relay(pool, LeastOutstandingPolicy(), RelayConfig(ttft_timeout_s=0.5, max_attempts=1))
    start = inference_pb2.GenerateStart(
        request_id="ttft-1",
        messages=[common_pb2.ChatMessage(role="user", content=text)],
        sampling=common_pb2.SamplingParams(max_tokens=3),
    )
    try:
        batches = [
            b async for b in relay.generate(start, PlacementRequest(models=["synthetic"]), RelayOutcome())
        ]
    finally:
        await pool.close()
    return sum(len(c.token_ids) for b in batches for c in b)


async def test_a_long_prompt_waits_for_its_prefill_and_a_short_one_times_out(
    slow_prefill: ServiceProcess,
) -> None:
    # 4,000 bytes ≈ 2,000 tokens at 1 ms each: 0.5 + 2 × 2 s = 4.5 s allowed, 1.5 s taken.
    # With a fixed limit it failed over (503 after every replica) and counted towards ejection.
    assert await first_tokens(slow_prefill, "lorem ipsum " * 333, prefill_s_per_token=0.001) == 3
    with pytest.raises(Exception, match="ttft_timeout"):
        await first_tokens(slow_prefill, "hi", prefill_s_per_token=0.001)
    with pytest.raises(Exception, match="ttft_timeout"):  # a cost not learned yet: the base alone
        await first_tokens(slow_prefill, "lorem ipsum " * 333, prefill_s_per_token=None)


def test_the_limit_is_the_base_plus_twice_the_prompts_expected_prefill() -> None:
    assert ttft_limit(60.0, 0.007, 8000) == pytest.approx(60.0 + 2 * 8000 * 0.007)
    assert ttft_limit(60.0, None, 8000) == ttft_limit(60.0, 0.007, 0) == 60.0
    ids = inference_pb2.GenerateStart(prompt_token_ids=list(range(300)))
    assert estimated_prompt_tokens(ids) == 300
    text = inference_pb2.GenerateStart(messages=[common_pb2.ChatMessage(role="user", content="水" * 100)])
    assert estimated_prompt_tokens(text) == 150  # 300 bytes: errs long for text outside ASCII
