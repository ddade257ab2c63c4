"""The inference replica under tight limits: tiny KV cache (preemption), tiny queue (overload), shutdown,
little memory."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.rpc import error_details_pb2, status_pb2
from transformers import AutoTokenizer

from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.support.device import reference_model, replica_device_args
from tests.support.inference import Generation, generate, greedy
from tests.support.processes import ROOT, ServiceProcess

pytestmark = pytest.mark.timeout(300)

# 6 blocks x 16 slots = 96 KV slots: four ~28-token sequences cannot all stay resident.
KV_BLOCKS = 6
MAX_QUEUED = 4
MAX_SEQS = 4


@pytest.fixture(scope="module")
def replica(model_path: Path) -> Iterator[ServiceProcess]:
    proc = ServiceProcess(
        "services.inference",
        [
            "--model", str(model_path),
            "--kv-blocks", str(KV_BLOCKS),
            "--block-size", "16",
            "--max-queued-requests", str(MAX_QUEUED),
            "--max-num-seqs", str(MAX_SEQS),
            "--metrics-port", "0",
            "--grace-seconds", "60",
            *replica_device_args(),
        ],
    )  # fmt: skip
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()


def metric(replica: ServiceProcess, name: str) -> float:
    """Sum of a metric's samples on the replica's Prometheus endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith(name) and (line[len(name)] in " {")
    )


PROMPTS = [
    "The four seasons of the year are",
    "A good recipe for bread needs flour, water,",
    "Robots that learn to paint start by",
    "The longest river in the world is",
]


async def test_preemption_under_a_tiny_kv_cache_still_gives_exact_outputs(
    replica: ServiceProcess, stub: inference_pb2_grpc.InferenceStub, model_path: Path
) -> None:
    max_tokens = 20
    starts = [
        inference_pb2.GenerateStart(prompt=p, sampling=greedy(max_tokens, ignore_eos=True)) for p in PROMPTS
    ]
    results = await asyncio.gather(*(generate(stub, s) for s in starts))

    assert metric(replica, "llmmesh_preemptions_total") > 0, "the cache was meant to be too small"
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    model = reference_model(model_path)
    for prompt, got in zip(PROMPTS, results, strict=True):
        assert got.finish_reason == common_pb2.FINISH_REASON_LENGTH
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            out = model.generate(
                # eos_token_id=-1: keep going past EOS, as ignore_eos does (the bench peers do the same).
                torch.tensor([ids], device=model.device),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=-1,
            )
        assert got.token_ids == out[0, len(ids) :].tolist()
    load = await stub.GetLoad(inference_pb2.GetLoadRequest())
    assert load.running == 0 and load.kv_blocks_used == 0


async def _try_generate(stub: inference_pb2_grpc.InferenceStub, i: int) -> Generation | grpc.aio.AioRpcError:
    start = inference_pb2.GenerateStart(prompt=f"Request number {i} says", sampling=greedy(2))
    try:
        return await generate(stub, start, timeout=60)
    except grpc.aio.AioRpcError as err:
        return err


async def test_overload_is_refused_at_once_with_retry_info(
    replica: ServiceProcess, stub: inference_pb2_grpc.InferenceStub
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    outcomes = await asyncio.wait_for(asyncio.gather(*(_try_generate(stub, i) for i in range(24))), 120)

    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    served = [o for o in outcomes if isinstance(o, Generation)]
    assert refused, "24 simultaneous requests against a queue of 4 must overflow it"
    assert served, "the queue still serves what it admitted"
    for err in refused:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in (err.details() or "")
        details = dict(err.trailing_metadata() or ())["grpc-status-details-bin"]
        status = status_pb2.Status.FromString(details)  # type: ignore[arg-type]
        info = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(info) and info.retry_delay.seconds >= 1
    for gen in served:
        assert gen.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(gen.token_ids) == 2
    assert loop.time() - started < 120
    assert metric(replica, "llmmesh_inference_requests_total") >= len(served)


async def test_sigterm_finishes_in_flight_work_then_exits(
    replica: ServiceProcess, stub: inference_pb2_grpc.InferenceStub
) -> None:
    start = inference_pb2.GenerateStart(prompt="Slowly, the robot", sampling=greedy(20, ignore_eos=True))
    call = stub.Generate(timeout=120)
    await call.write(inference_pb2.GenerateRequest(start=start))
    first = await call.read()
    assert first.HasField("chunk")

    replica.signal(signal.SIGTERM)
    tokens = list(first.chunk.token_ids)
    finished: Any = None
    while (response := await call.read()) is not grpc.aio.EOF:
        if response.HasField("chunk"):
            tokens.extend(response.chunk.token_ids)
        else:
            finished = response.finished
    assert finished is not None and finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(tokens) == 20
    assert replica.proc is not None
    assert await asyncio.to_thread(replica.proc.wait, 60) == 0


MEMORY_LINE = re.compile(
    r"memory: (\d+) MiB may be used \(--memory-limit-mib\), (\d+) MiB resident with the weights ready"
    r"(?: \(\d+ MiB of it still to come: the compiled decode step\))?; "
    r"KV cache (\d+) MiB \((\d+) blocks, \d+ tokens\), decode slab up to (\d+) MiB"
)


async def test_a_replica_given_little_memory_sizes_its_cache_and_slab_to_fit(model_path: Path) -> None:
    # What a 4 GiB container limit does (read from the cgroup when the flag is absent).
    proc = ServiceProcess("services.inference", ["--model", str(model_path), "--memory-limit-mib", "4096"])
    with proc:
        match = MEMORY_LINE.search(proc.output())
        assert match, proc.output()
        limit, resident, kv_mib, blocks, slab_mib = map(int, match.groups())
        assert limit == 4096
        assert re.search(r"KV cache cut from 409\d to \d+ MiB to fit 4096 MiB", proc.output())
        # Weights, a step's reserve (1 GiB), cache and slab within 90 % of the limit.
        assert resident + 1024 + kv_mib + slab_mib <= 0.9 * limit
        assert 0 < kv_mib < 4096 and 0 < slab_mib < 1024
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
            assert info.kv_blocks_total == blocks
            # Room for at least one whole context of the model's length.
            assert blocks * info.kv_block_size >= info.max_context_tokens
            start = inference_pb2.GenerateStart(prompt="The capital of France is", sampling=greedy(4))
            assert len((await generate(stub, start)).token_ids) == 4


@pytest.mark.full
def test_a_compiled_replica_counts_its_compiled_step_before_sizing_its_cache(model_path: Path) -> None:
    # --compile builds the decode graph after the cache is sized: a plan on the RSS of that moment
    # alone would leave the graph's packed weights and the compiler's state outside the limit.
    import psutil

    args = ["--model", str(model_path), "--memory-limit-mib", "4096", "--dtype", "bfloat16", "--compile"]
    proc = ServiceProcess("services.inference", args)
    try:
        proc.start(timeout=600)  # compiling the decode step takes ≈ 100 s here
        assert proc.proc is not None
        match = MEMORY_LINE.search(proc.output())
        assert match, proc.output()
        limit, resident, kv_mib, _, slab_mib = map(int, match.groups())
        coming = re.search(r"\((\d+) MiB of it still to come", proc.output())
        assert coming and int(coming.group(1)) >= 200, proc.output()
        assert resident + 1024 + kv_mib + slab_mib <= 0.9 * limit
        # Serving now: what the compile added is within what the plan counted (the KV cache is
        # still untouched; the warm-up's slab rows are the slab's own budget).
        rss_mib = psutil.Process(proc.proc.pid).memory_info().rss >> 20
        assert rss_mib <= resident + slab_mib, (rss_mib, resident, slab_mib)
    finally:
        proc.stop()


def test_a_replica_whose_memory_cannot_hold_one_context_refuses_to_start(model_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.inference", "--model", str(model_path), "--port", "0",
         "--memory-limit-mib", "2048"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "inference failed to start" in output
    assert "2048 MiB of memory (--memory-limit-mib) leaves" in output
    assert "less than one 8192-token context" in output and "Raise the memory limit" in output
