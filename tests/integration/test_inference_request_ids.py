"""Two generations under one client-chosen request_id on a real replica: a cancel reaches its own.

A direct client picks its request ids (a job id, a retry's), so two may meet on one replica. A
cancel names its generation only by that id; the replica marked cancels of generations still
being tokenized in one table keyed by the id, so client B's cancel ended client A's generation
and B's ran on. Now a second generation under a running id is ALREADY_EXISTS naming request_id
(the engine refused it too, once both got that far), at once, so a cancel by id has one
generation to reach. Each race is made reliable as the audit's repro made it: a prompt of about
1 MB holds the replica's one tokenizer thread for a second or so, so both generations are being
tokenized when the cancel comes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.support.inference import Generation, generate, greedy
from tests.support.processes import ServiceProcess

pytestmark = pytest.mark.timeout(300)

ANSWER_TOKENS = 20
#: About 1 MB: under the replica's unread refusal (128 characters a token of the context), so it
#: is tokenized (the thread is busy with it for a second or more), then refused as too long.
BLOCKER = "word " * 200_000


@pytest.fixture(scope="module")
def replica(shared_replica: ServiceProcess) -> ServiceProcess:
    return shared_replica


def start(request_id: str, prompt: str) -> inference_pb2.GenerateStart:
    return inference_pb2.GenerateStart(
        request_id=request_id, prompt=prompt, sampling=greedy(ANSWER_TOKENS, ignore_eos=True)
    )


async def blocker(stub: inference_pb2_grpc.InferenceStub) -> grpc.StatusCode:
    """A generation whose prompt holds the tokenizer thread, then is refused (too long)."""
    try:
        await generate(stub, start("blocker", BLOCKER))
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def cancelled_soon(
    stub: inference_pb2_grpc.InferenceStub, begin: inference_pb2.GenerateStart, after_s: float
) -> Generation | grpc.aio.AioRpcError:
    """A Generate call that sends its `cancel` ``after_s`` after its `start`, and reads to its end."""
    call: Any = stub.Generate(timeout=120)  # type: ignore[call-arg]  # grpc.aio, typed as the sync stub
    await call.write(inference_pb2.GenerateRequest(start=begin))

    async def cancel_later() -> None:
        await asyncio.sleep(after_s)
        # The call may already have been refused: then there is nothing left to write to.
        try:
            await call.write(inference_pb2.GenerateRequest(cancel=inference_pb2.CancelGeneration(reason="B")))
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass

    canceller = asyncio.create_task(cancel_later())
    result = Generation()
    try:
        async for response in _responses(call):
            if response.HasField("chunk"):
                result.token_ids.extend(response.chunk.token_ids)
            else:
                result.finished = response.finished
    except grpc.aio.AioRpcError as exc:
        return exc
    finally:
        await canceller
    return result


async def _responses(call: Any) -> AsyncIterator[Any]:
    while (response := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
        yield response


async def test_a_cancel_by_a_second_client_under_the_same_request_id_never_ends_the_first_ones(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    reference = await generate(stub, start("reference", "Tell me about the sea."))
    assert len(reference.token_ids) == ANSWER_TOKENS

    held = asyncio.create_task(blocker(stub))
    await asyncio.sleep(0.05)
    first = asyncio.create_task(generate(stub, start("job-1", "Tell me about the sea.")))
    await asyncio.sleep(0.05)
    second = await cancelled_soon(stub, start("job-1", "Tell me about cats."), after_s=0.1)
    answer = await first
    assert await held == grpc.StatusCode.INVALID_ARGUMENT  # the blocker was too long, as meant

    # The first client never cancelled: its answer is whole, token for token.
    assert answer.finish_reason == common_pb2.FINISH_REASON_LENGTH, "B's cancel ended A's generation"
    assert answer.token_ids == reference.token_ids
    # The second start under the running id was refused, naming the field.
    assert isinstance(second, grpc.aio.AioRpcError), f"two live generations under job-1: {second}"
    assert second.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "request_id" in (second.details() or "") and "job-1" in (second.details() or "")

    # Once the first has ended, the id is free again.
    again = await generate(stub, start("job-1", "Tell me about the sea."))
    assert again.token_ids == reference.token_ids


async def test_two_tags_of_one_stream_under_one_request_id_a_cancel_of_the_second_leaves_the_first(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    reference = await generate(stub, start("reference", "Tell me about the sea."))
    held = asyncio.create_task(blocker(stub))
    await asyncio.sleep(0.05)
    call: Any = stub.GenerateMany(timeout=120)  # type: ignore[call-arg]
    await call.write(inference_pb2.GenerateManyRequest(tag=1, start=start("dup", "Tell me about the sea.")))
    await asyncio.sleep(0.05)
    await call.write(inference_pb2.GenerateManyRequest(tag=2, start=start("dup", "Tell me about cats.")))
    await asyncio.sleep(0.1)
    await call.write(inference_pb2.GenerateManyRequest(tag=2, cancel=inference_pb2.CancelGeneration()))
    await call.done_writing()
    tokens: dict[int, list[int]] = {}
    ends: dict[int, inference_pb2.GenerationEvent] = {}
    async for response in _responses(call):
        for event in response.events:
            if event.HasField("chunk"):
                tokens.setdefault(event.tag, []).extend(event.chunk.token_ids)
            else:
                ends[event.tag] = event
    assert await held == grpc.StatusCode.INVALID_ARGUMENT

    assert ends[1].finished.finish_reason == common_pb2.FINISH_REASON_LENGTH, "tag 2's cancel ended tag 1"
    assert tokens[1] == reference.token_ids
    assert ends[2].WhichOneof("event") == "error" and 2 not in tokens, ends[2]
    assert ends[2].error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    assert "request_id" in ends[2].error.message


async def test_a_cancel_while_the_prompt_is_tokenized_still_ends_its_own_generation(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    # The one-generation case the table was for: cancelled before the engine knew it, it ends
    # CANCELLED without a token (and a later start under the id runs).
    held = asyncio.create_task(blocker(stub))
    await asyncio.sleep(0.05)
    alone = await cancelled_soon(stub, start("job-2", "Tell me about cats."), after_s=0.1)
    await held
    assert isinstance(alone, Generation), alone
    assert alone.finish_reason == common_pb2.FINISH_REASON_CANCELLED and alone.token_ids == []
    after = await generate(stub, start("job-2", "Tell me about cats."))
    assert after.finish_reason == common_pb2.FINISH_REASON_LENGTH
