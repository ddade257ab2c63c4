"""The inference service's plug-in for the shared server bootstrap: load, warm up, serve, drain."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence as Seq

import grpc

from services.common.server import HealthReporter
from services.inference.async_engine import AsyncEngine
from services.inference.config import EngineConfig
from services.inference.engine import LLMEngine
from services.inference.engine_thread import EngineThread
from services.inference.sampling import SamplingParams
from services.inference.servicer import InferenceServicer, add_to_server

log = logging.getLogger("llmmesh.inference")

# How long `drain` waits for in-flight generations before the server's own grace period.
DRAIN_POLL_S = 0.1


class InferenceRuntime:
    """Loads the engine off the event loop and reports SERVING after one real generation."""

    service_names: Seq[str] = ("llmmesh.v1.Inference",)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.servicer = InferenceServicer()
        self.engine: AsyncEngine | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # held so they finish (the loop keeps weak refs)

    def register(self, server: grpc.aio.Server) -> None:
        add_to_server(self.servicer, server)

    async def start(self, health: HealthReporter) -> None:
        # Load, warm up and serve on one thread: one OpenMP pool (engine_thread.py says why).
        thread = EngineThread()
        core = await thread.run(LLMEngine, self.config)
        # Warm-up: one real generation, so the first client does not pay for lazy init.
        warm = await thread.run(
            core.generate, [core.tokenizer.encode("Hello")], SamplingParams(max_tokens=2, temperature=0.0)
        )
        log.info("warm-up generated %d tokens", len(warm[0]))
        loop = asyncio.get_running_loop()

        def stop_serving(reason: str) -> None:  # engine thread: the health status is the loop's
            log.error("replica NOT_SERVING: the inference engine failed (%s)", reason)
            loop.call_soon_threadsafe(lambda: self._tasks.add(loop.create_task(health.set_serving(False))))

        self.engine = AsyncEngine(core, on_failure=stop_serving, thread=thread)
        self.servicer.engine = self.engine
        await health.set_serving(True)

    async def drain(self) -> None:
        # New generations are refused; the server's grace period lets in-flight ones finish.
        self.servicer.drain()

    async def close(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)
