"""One bad request never hurts another, on a real replica and through the router.

Every poison input (contract-valid but numerically hostile sampling settings, or a fault
injected into one row's sampling) runs in one batch beside a greedy bystander stream. The bystander's
tokens must equal its solo run, the poison must get a clear answer (its settings served as
documented, or a status naming the field, or INTERNAL for a fault that was its own), and
the replica must stay SERVING and in the router's pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc
from tests.support.device import replica_device_args
from tests.support.faulty_replica import FAULT_SEED, FAULT_TOKEN_INDEX
from tests.support.inference import Generation, generate, greedy
from tests.support.processes import ServiceProcess
from tests.support.router_mesh import router_process, user_turn

pytestmark = pytest.mark.timeout(300)

BYSTANDER_PROMPT = "Write a long story about a lighthouse keeper and the sea."
POISON_PROMPT = "List the planets of the solar system."
BYSTANDER_TOKENS = 64
POISON_TOKENS = 16


@pytest.fixture(scope="module")
def replica(model_path: Path) -> Iterator[ServiceProcess]:
    proc = ServiceProcess(
        "tests.support.faulty_replica",
        ["--model", str(model_path), "--kv-blocks", "256", *replica_device_args()],
    )
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()


def start(prompt: str, sampling: common_pb2.SamplingParams) -> inference_pb2.GenerateStart:
    return inference_pb2.GenerateStart(prompt=prompt, sampling=sampling)


def bystander_start() -> inference_pb2.GenerateStart:
    return start(BYSTANDER_PROMPT, greedy(BYSTANDER_TOKENS, ignore_eos=True))


def sampled(**fields: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=POISON_TOKENS, ignore_eos=True, **fields)


#: (name, sampling, expected outcome): "greedy" = served, tokens equal to the greedy run;
#: "served" = runs to max_tokens; "invalid:<field>" = INVALID_ARGUMENT naming it;
#: "fault" = INTERNAL after the tokens before the faulty one.
POISONS: list[tuple[str, common_pb2.SamplingParams, str]] = [
    ("temperature 1e-40", sampled(temperature=1e-40, seed=1), "greedy"),
    ("temperature 1e-30 with penalty", sampled(temperature=1e-30, repetition_penalty=1.3), "served"),
    ("temperature 3.4e38", sampled(temperature=3.4e38, seed=2), "served"),
    (
        "repetition_penalty 1.4e-45",
        sampled(temperature=0.8, repetition_penalty=1.4e-45),
        "invalid:repetition_penalty",
    ),
    (
        "repetition_penalty 1e30",
        sampled(temperature=0.8, repetition_penalty=1e30),
        "invalid:repetition_penalty",
    ),
    ("repetition_penalty at the floor", sampled(temperature=0.8, repetition_penalty=0.01, seed=3), "served"),
    (
        "repetition_penalty at the ceiling",
        sampled(temperature=1.0, repetition_penalty=100.0, seed=4),
        "served",
    ),
    ("top_p 1e-45", sampled(temperature=1.0, top_p=1e-45, seed=5), "greedy"),
    ("top_k 1", sampled(temperature=2.0, top_k=1, seed=6), "greedy"),
    ("top_k 2^31-1", sampled(temperature=1.0, top_k=2**31 - 1, seed=7), "served"),
    ("fault in one row's sampling", sampled(temperature=0.8, seed=FAULT_SEED), "fault"),
]


async def run_poison(
    stub: inference_pb2_grpc.InferenceStub, sampling: common_pb2.SamplingParams
) -> Generation | grpc.aio.AioRpcError:
    try:
        return await generate(stub, start(POISON_PROMPT, sampling), timeout=60)
    except grpc.aio.AioRpcError as exc:
        return exc


async def test_a_poison_input_never_changes_a_bystanders_tokens(replica: ServiceProcess) -> None:
    async with grpc.aio.insecure_channel(replica.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        alone = (await generate(stub, bystander_start())).token_ids
        poison_greedy = (
            await generate(stub, start(POISON_PROMPT, greedy(POISON_TOKENS, ignore_eos=True)))
        ).token_ids
        # Every poison in one batch beside the bystander: whatever one of them does to its own
        # rows must reach neither the bystander nor the other poisons.
        bystander = asyncio.create_task(generate(stub, bystander_start()))
        await asyncio.sleep(0.2)  # the bystander is in the running batch when the poisons arrive
        outcomes = await asyncio.gather(*(run_poison(stub, sampling) for _, sampling, _ in POISONS))
        assert (await bystander).token_ids == alone, "the bystander's tokens changed"
        for (name, _, expected), outcome in zip(POISONS, outcomes, strict=True):
            if expected == "fault":
                assert isinstance(outcome, grpc.aio.AioRpcError), name
                assert outcome.code() == grpc.StatusCode.INTERNAL, (name, outcome)
                assert "injected fault" in (outcome.details() or ""), outcome.details()
            elif expected.startswith("invalid:"):
                assert isinstance(outcome, grpc.aio.AioRpcError), name
                assert outcome.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, outcome)
                assert (outcome.details() or "").startswith(expected.removeprefix("invalid:") + ":")
            else:
                assert isinstance(outcome, Generation), (name, outcome)
                assert outcome.finish_reason == common_pb2.FINISH_REASON_LENGTH, name
                assert len(outcome.token_ids) == POISON_TOKENS, name
                if expected == "greedy":
                    assert outcome.token_ids == poison_greedy, name
        # The fault streamed the tokens before it, then ended; the replica is still SERVING and idle.
        assert replica.health() == health_pb2.HealthCheckResponse.SERVING
        load = await stub.GetLoad(inference_pb2.GetLoadRequest())
        assert (load.running, load.waiting, load.kv_blocks_used) == (0, 0, 0)


def test_a_request_fault_through_the_router_is_the_requests_alone(replica: ServiceProcess) -> None:
    """The router passes the fault on as INTERNAL without failing over and without counting it
    against the replica: more faults than the ejection threshold leave it in the pool."""
    with router_process([replica]) as router, grpc.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        bystander_turn = user_turn(BYSTANDER_PROMPT, max_tokens=BYSTANDER_TOKENS, ignore_eos=True)
        alone = stub.Complete(bystander_turn, timeout=60)
        poison_turn = user_turn(POISON_PROMPT, max_tokens=POISON_TOKENS, temperature=0.8, ignore_eos=True)
        poison_turn.sampling.seed = FAULT_SEED
        for _ in range(5):  # the router ejects after 3 consecutive failures
            bystander = stub.Complete.future(bystander_turn, timeout=60)
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.ChatStream(poison_turn, timeout=60))
            assert caught.value.code() == grpc.StatusCode.INTERNAL, caught.value
            assert "injected fault" in (caught.value.details() or "")
            assert bystander.result().text == alone.text
        (status,) = stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5).replicas
        assert not status.ejected and status.ejection_count == 0
        assert status.health == router_pb2.REPLICA_HEALTH_SERVING
        # A stream gets the tokens before the faulty one, then the status.
        received: list[int] = []
        with pytest.raises(grpc.RpcError):
            for message in stub.ChatStream(poison_turn, timeout=60):
                received.extend(message.delta.token_ids)
        assert len(received) == FAULT_TOKEN_INDEX
