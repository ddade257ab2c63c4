"""A step that raises fails the requests in it and nothing else: the replica keeps serving.

On the first GPU run a bug made every forward of some batches raise; the requests of
a failed step must be released without running them again, or every later step
(carrying them) fails too and the replica is lost for requests that were fine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from services.common import errors
from services.inference.async_engine import AsyncEngine
from services.inference.config import EngineConfig
from services.inference.engine import LLMEngine
from services.inference.sampling import SamplingParams
from tests.support.device import TEST_DEVICE

pytestmark = pytest.mark.timeout(300)


class PoisonedForward:
    """The real forward, except that any step holding a ``poison-`` request raises, every time."""

    def __init__(self, execute: Any) -> None:
        self.execute = execute
        self.failures = 0

    def __call__(self, scheduled: Sequence[Any]) -> list[int]:
        if any(s.seq.request_id.startswith("poison-") for s in scheduled):
            self.failures += 1
            raise RuntimeError("this batch cannot run")
        return list(self.execute(scheduled))


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    tokens: list[int] = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for out in engine.generate(request_id, prompt, params):
        tokens.extend(out.new_token_ids)
    return tokens


async def test_a_step_that_keeps_failing_fails_its_requests_and_the_replica_serves_the_next(
    model_path: Path,
) -> None:
    core = LLMEngine(
        EngineConfig(model=str(model_path), dtype="float32", device=TEST_DEVICE, num_kv_blocks=64)
    )
    prompt = core.tokenizer.encode("The history of painting begins with")
    expected = core.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    poisoned = PoisonedForward(core.runner.execute)
    core.runner.execute = poisoned  # type: ignore[method-assign]
    engine = AsyncEngine(core)
    try:
        with pytest.raises(errors.DependencyUnavailable, match="inference engine failed"):
            await collect(engine, "poison-1", prompt, 8)
        # The failed request was released without another forward: its blocks are free.
        assert poisoned.failures == 1
        for _ in range(100):
            load = engine.load()
            if load.running == 0 and load.waiting == 0 and load.kv_blocks_used == 0:
                break
            await asyncio.sleep(0.05)
        assert (load.running, load.waiting, load.kv_blocks_used) == (0, 0, 0)
        # And the next request is served as if nothing had happened.
        assert await collect(engine, "fine-1", prompt, 8) == expected
    finally:
        engine.close()
