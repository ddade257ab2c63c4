"""A step that raises fails the request that caused it and nothing else: the others keep
their exact tokens, and the replica keeps serving. Only an engine-wide failure (out of
memory, the device lost) fails everything, and then the replica stops serving.

On the first GPU run a bug made every forward of some batches raise; the requests of a
failed step must be released without running them again, or every later step (carrying
them) fails too and the replica is lost for requests that were fine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common import errors
from services.inference.async_engine import AsyncEngine
from services.inference.config import EngineConfig
from services.inference.engine import LLMEngine
from services.inference.sampling import SamplingParams
from tests.support.device import TEST_DEVICE

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 12


class PoisonedForward:
    """The real forward, except that any step holding a ``poison-`` request raises ``error``."""

    def __init__(self, execute: Any, error: Exception | None = None) -> None:
        self.execute = execute
        self.error = error or RuntimeError("this batch cannot run")
        self.failures = 0

    def __call__(self, scheduled: Sequence[Any], *rest: Any) -> Sequence[Any]:
        # ``rest``: the runner's other arguments (the constrained rows' grammars), passed through.
        if any(s.seq.request_id.startswith("poison-") for s in scheduled):
            self.failures += 1
            raise self.error
        return self.execute(scheduled, *rest)


@pytest.fixture(scope="module")
def core(model_path: Path) -> Iterator[LLMEngine]:
    engine = LLMEngine(
        EngineConfig(model=str(model_path), dtype="float32", device=TEST_DEVICE, num_kv_blocks=128)
    )
    real = engine.runner.execute
    yield engine
    engine.runner.execute = real  # type: ignore[method-assign]


PROMPTS = [
    "The history of painting begins with",
    "Rivers carry water from the mountains to",
    "A good recipe for bread needs",
]
#: A long shared head: the poison's prefill fills blocks a bystander admitted in the same step reads.
SHARED_HEAD = "You are a careful assistant who answers questions about geography in detail. " * 6


def solo(core: LLMEngine, prompt: list[int]) -> list[int]:
    core.reset_prefix_cache()
    return core.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async for out in engine.generate(request_id, prompt, params):
        tokens.extend(out.new_token_ids)
    return tokens


async def wait_idle(engine: AsyncEngine) -> tuple[int, int, int]:
    for _ in range(100):
        load = engine.load()
        if load.running == 0 and load.waiting == 0 and load.kv_blocks_used == 0:
            break
        await asyncio.sleep(0.05)
    return load.running, load.waiting, load.kv_blocks_used


async def test_a_step_that_keeps_failing_fails_only_the_request_that_caused_it(core: LLMEngine) -> None:
    prompts = [core.tokenizer.encode(p) for p in PROMPTS]
    expected = [solo(core, p) for p in prompts]
    poisoned = PoisonedForward(core.runner.execute)
    core.runner.execute = poisoned  # type: ignore[method-assign]
    engine = AsyncEngine(core)
    try:
        bystanders = [asyncio.create_task(collect(engine, f"fine-{i}", p)) for i, p in enumerate(prompts)]
        await asyncio.sleep(0.3)  # the bystanders are decoding when the poison arrives
        with pytest.raises(errors.RequestFault, match="this batch cannot run"):
            await collect(engine, "poison-1", prompts[0])
        assert [await t for t in bystanders] == expected
        assert poisoned.failures >= 1
        assert engine.failure is None
        # The failed request was released: its blocks are free, and the next request is served.
        assert await wait_idle(engine) == (0, 0, 0)
        assert await collect(engine, "fine-next", prompts[1]) == expected[1]
    finally:
        engine.close()
        core.runner.execute = poisoned.execute  # type: ignore[method-assign]


async def test_a_bystander_that_read_the_failed_requests_blocks_recomputes_them(
    core: LLMEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """Admitted in the same step, the bystander matched the prefix blocks the poison was filling;
    the poison's forward never wrote them, so the bystander must compute that prefix itself."""
    poison_prompt = core.tokenizer.encode(SHARED_HEAD + "Where is Lima?")
    bystander_prompt = core.tokenizer.encode(SHARED_HEAD + "Where is Oslo?")
    expected = solo(core, bystander_prompt)
    core.reset_prefix_cache()
    poisoned = PoisonedForward(core.runner.execute)
    core.runner.execute = poisoned  # type: ignore[method-assign]
    engine = AsyncEngine(core)
    try:
        # Queued together: one step admits both, the poison first.
        poison = asyncio.create_task(collect(engine, "poison-shared", poison_prompt))
        bystander = asyncio.create_task(collect(engine, "fine-shared", bystander_prompt))
        with pytest.raises(errors.RequestFault):
            await poison
        assert await bystander == expected
        assert "fine-shared shares blocks with failed poison-shared" in caplog.text
        assert await wait_idle(engine) == (0, 0, 0)
    finally:
        engine.close()
        core.runner.execute = poisoned.execute  # type: ignore[method-assign]


async def test_an_engine_wide_failure_fails_every_request_and_stops_serving(core: LLMEngine) -> None:
    prompts = [core.tokenizer.encode(p) for p in PROMPTS]
    poisoned = PoisonedForward(core.runner.execute, torch.OutOfMemoryError("out of memory"))
    core.runner.execute = poisoned  # type: ignore[method-assign]
    failures: list[str] = []
    engine = AsyncEngine(core, on_failure=failures.append)
    try:
        bystanders = [asyncio.create_task(collect(engine, f"fine-oom-{i}", p)) for i, p in enumerate(prompts)]
        await asyncio.sleep(0.3)
        results = await asyncio.gather(
            collect(engine, "poison-oom", prompts[0]), *bystanders, return_exceptions=True
        )
        # Out of memory is the engine's failure, not one request's: no request goes on, none is bisected.
        assert all(isinstance(r, errors.DependencyUnavailable) for r in results), results
        assert poisoned.failures == 1
        assert len(failures) == 1 and "OutOfMemoryError" in failures[0]
        with pytest.raises(errors.DependencyUnavailable, match="engine failed"):
            await collect(engine, "fine-after", prompts[1])
    finally:
        engine.close()
        core.runner.execute = poisoned.execute  # type: ignore[method-assign]


@pytest.mark.parametrize("cancelled", [False, True], ids=["poison fails", "poison cancelled as it fails"])
def test_no_block_computed_over_the_failed_requests_stays_a_cached_prefix(
    core: LLMEngine, cancelled: bool
) -> None:
    """The bystander matched the blocks the poison was filling and computed its own after them,
    over what the poison never wrote. Those are garbage too: a later request with the
    bystander's prompt must not be served them from the prefix cache. Also when the poison's
    client cancels while its failing step runs (its blocks are freed by the cancel)."""
    bystander_prompt = core.tokenizer.encode(
        SHARED_HEAD + "Where is Oslo? Describe its fjords, climate, museums and food in a sentence each."
    )
    expected = solo(core, bystander_prompt)
    core.reset_prefix_cache()
    with torch.no_grad():
        for cache in core.runner.k_caches + core.runner.v_caches:
            cache.normal_()  # what earlier requests left in the blocks: never what a prompt needs
    real = core.runner.execute

    def failing(scheduled: Sequence[Any], *rest: Any) -> Sequence[Any]:
        if any(s.seq.request_id == "poison-held" for s in scheduled):
            if cancelled:
                core.abort_request("poison-held")
            raise RuntimeError("this batch cannot run")
        return real(scheduled, *rest)

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    core.runner.execute = failing  # type: ignore[method-assign]
    try:
        core.add_request("poison-held", core.tokenizer.encode(SHARED_HEAD + "Where is Lima?"), params)
        core.add_request("fine-held", bystander_prompt, params)
        first = core.step()  # one step admits both, the poison first; its forward fails
        assert {o.request_id for o in first if o.finished} == {"poison-held"}
    finally:
        core.runner.execute = real  # type: ignore[method-assign]
    tokens: list[int] = []
    while core.has_unfinished_requests():
        tokens += [t for o in core.step() if o.request_id == "fine-held" for t in o.new_token_ids]
    assert tokens == expected
    # The same prompt again: served from what the cache holds, which must be right.
    later = core.generate([bystander_prompt], params)[0]
    assert later == expected
    core.reset_prefix_cache()
