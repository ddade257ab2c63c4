"""A generation nobody reads is parked by the real engine: its seat and KV blocks go to others, and
once read again it goes on with exactly the tokens an uninterrupted run gives."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.support.device import replica_device_args
from tests.support.inference import generate, greedy
from tests.support.processes import ServiceProcess

pytestmark = pytest.mark.timeout(300)

PROMPT = "Count slowly from one to one thousand, one number per line:"
ANSWER_TOKENS = 120


@pytest.fixture(scope="module")
def replica(model_path: Path) -> Iterator[ServiceProcess]:
    # One seat in the batch: a second generation can only run if the first gave its seat back.
    proc = ServiceProcess(
        "services.inference",
        [
            "--model", str(model_path),
            "--max-num-seqs", "1",
            "--kv-blocks", "64",
            "--metrics-port", "0",
            *replica_device_args(),
        ],
    )  # fmt: skip
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()


def parked(replica: ServiceProcess) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    return sum(
        float(line.split()[1]) for line in body.splitlines() if line.startswith("llmmesh_parked_sequences ")
    )


class Stream:
    """One GenerateMany stream: tokens and ends per tag as they arrive."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub) -> None:
        self.call = stub.GenerateMany(timeout=240)
        self.tokens: dict[int, list[int]] = {}
        self.finished: dict[int, inference_pb2.GenerationFinished] = {}

    async def send(self, tag: int, **action: object) -> None:
        await self.call.write(inference_pb2.GenerateManyRequest(tag=tag, **action))  # type: ignore[arg-type]

    async def read_until(self, done: Callable[[], bool]) -> None:
        """Read events until ``done()`` holds."""
        while not done():
            response = await self.call.read()
            assert response is not grpc.aio.EOF, "the stream ended early"
            for event in response.events:
                assert event.WhichOneof("event") != "error", event.error.message
                if event.HasField("chunk"):
                    self.tokens.setdefault(event.tag, []).extend(event.chunk.token_ids)
                else:
                    self.finished[event.tag] = event.finished


async def test_a_paused_generation_frees_its_seat_and_resumes_with_the_uninterrupted_tokens(
    replica: ServiceProcess, stub: inference_pb2_grpc.InferenceStub
) -> None:
    start = inference_pb2.GenerateStart(prompt=PROMPT, sampling=greedy(ANSWER_TOKENS, ignore_eos=True))
    reference = await generate(stub, start)
    assert len(reference.token_ids) == ANSWER_TOKENS

    stream = Stream(stub)
    await stream.send(1, start=start)
    await stream.read_until(lambda: len(stream.tokens.get(1, [])) >= 4)
    # The router's `pause`: the replica stops taking the generation's tokens. The engine parks it.
    await stream.send(1, pause=inference_pb2.PauseGeneration())
    deadline = asyncio.get_running_loop().time() + 60
    while parked(replica) < 1:
        assert asyncio.get_running_loop().time() < deadline, "the unread generation was never parked"
        await asyncio.sleep(0.1)
    load = await stub.GetLoad(inference_pb2.GetLoadRequest())
    assert load.running == 0 and load.kv_blocks_used == 0, "a parked sequence holds no seat and no blocks"

    # The only seat is free: another generation runs to its end while the first one waits.
    other = inference_pb2.GenerateStart(prompt="Name three colours.", sampling=greedy(8, ignore_eos=True))
    await stream.send(2, start=other)
    await stream.read_until(lambda: 2 in stream.finished)
    assert len(stream.tokens[2]) == 8
    assert 1 not in stream.finished, "the paused generation did not run to its end meanwhile"

    await stream.send(1, resume=inference_pb2.ResumeGeneration())
    await stream.read_until(lambda: 1 in stream.finished)
    await stream.call.done_writing()
    assert stream.finished[1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert stream.tokens[1] == reference.token_ids, "parking changed the answer"
    assert stream.finished[1].usage.completion_tokens == ANSWER_TOKENS
    assert parked(replica) == 0
    load = await stub.GetLoad(inference_pb2.GetLoadRequest())
    assert load.running == 0 and load.waiting == 0
