"""The relay tells placement when an attempt's prompt is in a replica's cache (its first tokens)
and when it never got there (ended before them): the prefix policy's queued-prefill estimate."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.common.generate_many.client import ReplicaMultiplexer
from services.gen.llmmesh.v1 import common_pb2, inference_pb2
from services.router.placement.candidate import Candidate
from services.router.placement.policies import LeastOutstandingPolicy
from services.router.placement.pool import ReplicaPool
from services.router.placement.request import PlacementRequest, PromptPrefix
from services.router.streams.attempts import ReplicaRejected
from services.router.streams.relay import Relay, RelayOutcome
from tests.support.processes import ServiceProcess
from tests.support.router_mesh import synthetic_replica

PREFIX = PromptPrefix(hashes=(11, 22, 33), block_size=16, prompt_tokens=40)


class RecordingPolicy(LeastOutstandingPolicy):
    """Least outstanding, noting what the relay tells it of each attempt."""

    def __init__(self) -> None:
        super().__init__()
        self.prefilled_on: list[str] = []
        self.withdrawn_from: list[str] = []

    def prefilled(self, chosen: Candidate, request: PlacementRequest) -> None:
        assert request.prefix_hashes == PREFIX.hashes
        self.prefilled_on.append(chosen.address)

    def withdrawn(self, chosen: Candidate, request: PlacementRequest) -> None:
        self.withdrawn_from.append(chosen.address)


@pytest.fixture(scope="module")
def replica() -> Iterator[ServiceProcess]:
    process = synthetic_replica().start()
    yield process
    process.stop()


async def relay_turn(
    replica: ServiceProcess, start: inference_pb2.GenerateStart, policy: RecordingPolicy
) -> int:
    """The tokens the relay streamed for ``start`` from ``replica``, placed by ``policy``."""
    pool = ReplicaPool(ReplicaMultiplexer)
    pool.set_addresses([replica.address])
    (only,) = pool.replicas.values()
    only.model, only.serving = "synthetic", True
    relay = Relay(pool, policy)
    try:
        placement = PlacementRequest(models=["synthetic"], request_id=start.request_id, prefix=PREFIX)
        batches = [b async for b in relay.generate(start, placement, RelayOutcome())]
    finally:
        await pool.close()
    return sum(len(c.token_ids) for b in batches for c in b)


def start_of(request_id: str, max_tokens: int) -> inference_pb2.GenerateStart:
    return inference_pb2.GenerateStart(
        request_id=request_id,
        messages=[common_pb2.ChatMessage(role="user", content="hello there")],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


async def test_an_attempt_that_streamed_is_prefilled_once_and_never_withdrawn(
    replica: ServiceProcess,
) -> None:
    # Twelve tokens come in several batches; the notice is the first batch's alone.
    policy = RecordingPolicy()
    tokens = await relay_turn(replica, start_of("prefilled-1", 12), policy)
    assert tokens == 12
    assert policy.prefilled_on == [replica.address] and policy.withdrawn_from == []


async def test_an_attempt_refused_before_its_first_token_is_withdrawn_not_prefilled(
    replica: ServiceProcess,
) -> None:
    policy = RecordingPolicy()
    # Past the replica's context: INVALID_ARGUMENT, which every replica would say (one attempt).
    with pytest.raises(ReplicaRejected, match="context"):
        await relay_turn(replica, start_of("refused-1", 10_000_000), policy)
    assert policy.withdrawn_from == [replica.address] and policy.prefilled_on == []
