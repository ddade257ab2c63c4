"""Costly output constraints against the real model (fp32, the test device), through the async
front as a replica runs it: a schema whose first token costs seconds of mask is refused at
admission, and a plain stream beside clients that keep sending it is not stalled (each of
those requests held every step for the whole mask, 0.8 s here); a schema that gets too
costly part-way ends the request that got there and is refused to the next one at once."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from services.common import errors
from services.inference.async_engine import AsyncEngine
from services.inference.engine import LLMEngine
from services.inference.sampling import Constraint, ConstraintKind, SamplingParams
from tests.support.device import fp32_engine

pytestmark = pytest.mark.timeout(300)

PROMPT = "Tell me a long story about a dragon."
#: A step of this model on 2 shared CPU cores takes ~20-60 ms; a stalled one took 0.8 s.
STALL_S = 0.5


@pytest.fixture(scope="module")
def core(model_path: Path) -> LLMEngine:
    return fp32_engine(model_path)


def allof_of_anyofs(n: int, k: int) -> dict[str, Any]:
    """``allOf`` of n ``anyOf``s of k one-property objects: k**n object shapes open at once."""
    return {
        "allOf": [
            {
                "anyOf": [
                    {"type": "object", "properties": {f"a{i}_{j}": {"type": "integer"}}} for j in range(k)
                ]
            }
            for i in range(n)
        ]
    }


def constrained(value: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=24, temperature=0.0, constraint=Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(value))
    )


async def token_gaps(engine: AsyncEngine, request_id: str, prompt: list[int]) -> list[float]:
    """A plain greedy stream's gaps between tokens (s)."""
    gaps: list[float] = []
    last: float | None = None
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    async for out in engine.generate(request_id, prompt, params):
        if out.new_token_ids:
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


async def drain(engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    async for _ in engine.generate(request_id, prompt, params):
        pass


async def test_a_schema_too_costly_at_its_first_token_does_not_stall_a_stream_beside_it(
    core: LLMEngine,
) -> None:
    prompt = core.tokenizer.encode(PROMPT)
    hostile = constrained(allof_of_anyofs(3, 13))  # 2.5 KB, 39 properties: ~0.8 s a first mask
    engine = AsyncEngine(core)
    try:
        alone = await token_gaps(engine, "alone", prompt)
        # The first one compiles it (as the audit's clients did before looping on the cached schema).
        with pytest.raises(errors.InvalidArgument) as first:
            await drain(engine, "hostile-first", prompt, hostile)
        assert first.value.field == "json_schema"
        refusals: list[errors.InvalidArgument] = []
        stop = asyncio.Event()

        async def client(name: str) -> None:
            sent = 0
            while not stop.is_set():
                try:
                    await drain(engine, f"{name}-{sent}", prompt, hostile)
                except errors.InvalidArgument as exc:
                    refusals.append(exc)
                sent += 1
                await asyncio.sleep(0.02)  # a client's round trip

        clients = [asyncio.create_task(client(f"hostile-{i}")) for i in range(2)]
        try:
            beside = await token_gaps(engine, "beside", prompt)
        finally:
            stop.set()
            await asyncio.gather(*clients)
    finally:
        engine.close()
    assert refusals and all(r.field == "json_schema" for r in refusals)
    assert len(beside) == len(alone) == 39
    # Generous: ten times a step, a quarter of the stall the schema caused.
    assert max(beside) < STALL_S, (max(beside), max(alone), len(refusals))


async def test_a_schema_too_costly_part_way_ends_that_request_and_is_refused_to_the_next(
    core: LLMEngine,
) -> None:
    """A short free string, then the audit's ``allOf``: cheap at its first token (it compiles),
    0.4 s a mask once the object after "a" opens."""
    prompt = core.tokenizer.encode("Write a JSON object.")
    hostile = constrained(
        {
            "type": "object",
            "properties": {"x": {"type": "string", "maxLength": 3}, "a": allof_of_anyofs(3, 12)},
            "required": ["x", "a"],
        }
    )
    engine = AsyncEngine(core)
    try:
        with pytest.raises(errors.InvalidArgument) as got_there:
            await drain(engine, "first", prompt, hostile)
        assert str(got_there.value).startswith("json_schema: the output constraint cannot go on"), (
            got_there.value
        )
        started = time.perf_counter()
        with pytest.raises(errors.InvalidArgument) as next_one:
            await drain(engine, "next", prompt, hostile)
        assert time.perf_counter() - started < STALL_S
        assert str(next_one.value).startswith("json_schema: refused on this replica"), next_one.value
        # Nothing left behind: the load is published after each step, so give it a moment.
        deadline = time.perf_counter() + 10
        while (load := engine.load()).running or load.waiting:
            assert time.perf_counter() < deadline, load
            await asyncio.sleep(0.05)
    finally:
        engine.close()
