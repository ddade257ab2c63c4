"""A replica loads, warms up and runs its engine loop on one thread (one OpenMP pool: engine_thread.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from services.inference import runtime as runtime_module
from services.inference.engine_thread import EngineThread
from services.inference.outputs import EngineLoad, RequestOutput
from services.inference.runtime import InferenceRuntime
from services.inference.sampling import SamplingParams

from .test_async_engine import FakeTokenEngine


def test_calls_run_in_order_on_the_one_thread_and_errors_come_back() -> None:
    thread = EngineThread()
    try:
        slow = thread.submit(time.sleep, 0.2)
        after = thread.submit(threading.get_ident)
        assert not after.done()  # queued behind the slow call, not run on a second thread
        assert after.result(5) == thread.ident
        assert slow.done()
        failing = thread.submit(int, "not a number")
        with pytest.raises(ValueError, match="not a number"):
            failing.result(5)
        # The thread survives a call that raised.
        assert thread.submit(threading.get_ident).result(5) == thread.ident
    finally:
        thread.stop()
    assert not any(t.ident == thread.ident for t in threading.enumerate())


class RecordingEngine(FakeTokenEngine):
    """LLMEngine's surface as the runtime uses it, noting the thread of each torch-bearing call."""

    seen: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, config: Any) -> None:
        super().__init__(tokens=3)
        RecordingEngine.seen.append(("load", threading.get_ident()))
        self.tokenizer = SimpleNamespace(encode=lambda text: [1, 2])

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        RecordingEngine.seen.append(("warm-up", threading.get_ident()))
        return [[7] * params.max_tokens]

    def step(self) -> list[RequestOutput]:
        RecordingEngine.seen.append(("step", threading.get_ident()))
        return super().step()

    def load(self) -> EngineLoad:
        return super().load()


class Health:
    def __init__(self) -> None:
        self.serving: bool | None = None

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving


async def test_the_replica_loads_warms_up_and_steps_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    RecordingEngine.seen = []
    monkeypatch.setattr(runtime_module, "LLMEngine", RecordingEngine)
    replica = InferenceRuntime(SimpleNamespace())  # type: ignore[arg-type]
    health = Health()
    await replica.start(health)  # type: ignore[arg-type]
    try:
        assert health.serving is True
        assert replica.engine is not None
        got = [out async for out in replica.engine.generate("r1", [1, 2], SamplingParams(max_tokens=3))]
        assert [t for o in got for t in o.new_token_ids] == [100, 101, 102]
    finally:
        await replica.close()
    kinds = [kind for kind, _ in RecordingEngine.seen]
    assert kinds[:2] == ["load", "warm-up"] and "step" in kinds
    threads = {ident for _, ident in RecordingEngine.seen}
    assert len(threads) == 1, RecordingEngine.seen
    assert threading.get_ident() not in threads  # never the event loop's thread
    # close() ended the thread: nothing of the engine is left running.
    await asyncio.sleep(0)
    assert not any(t.ident in threads for t in threading.enumerate())


def test_a_replicas_idle_openmp_worker_sleeps_at_once_unless_the_operator_chose() -> None:
    from services.inference.openmp_policy import OPERATOR_KNOBS, default_wait_policy

    env: dict[str, str] = {"PATH": "/bin"}
    assert default_wait_policy(env) == "PASSIVE"
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    for knob in OPERATOR_KNOBS:  # a replica with dedicated CPUs: GOMP_SPINCOUNT=300000, kept as set
        chosen = {knob: "300000"}
        assert default_wait_policy(chosen) is None
        assert chosen == {knob: "300000"}


def test_the_replicas_entry_point_sets_the_policy_before_torch_loads() -> None:
    # libgomp reads OMP_WAIT_POLICY once, when torch loads it: the entry module must not import torch.
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "os.environ.pop('OMP_WAIT_POLICY', None); os.environ.pop('GOMP_SPINCOUNT', None)\n"
        "import services.inference.__main__ as entry\n"
        "assert 'torch' not in sys.modules, 'torch loaded before the OpenMP policy'\n"
        "entry.default_wait_policy(os.environ)\n"
        "print(os.environ['OMP_WAIT_POLICY'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "PASSIVE"


async def test_a_prompt_longer_than_any_context_could_hold_is_refused_before_it_is_tokenized() -> None:
    """A 3 MB prompt was tokenized for 4.4 s only to be refused as too long, and 500,000 empty
    messages (4 MB) rendered for 21.7 s: past 128 characters a token of the context, or more
    messages than it has tokens, the prompt is refused without being read."""
    from services.common.errors import ContextTooLong
    from services.gen.llmmesh.v1 import common_pb2, inference_pb2
    from services.inference.servicer import MAX_CHARS_PER_TOKEN, start_generation

    class Unread:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"the prompt was tokenized ({name})")

    engine = SimpleNamespace(engine=SimpleNamespace(tokenizer=Unread(), max_model_len=8192))
    over = "x" * (8192 * MAX_CHARS_PER_TOKEN + 1)
    empty = common_pb2.ChatMessage(role="user", content="")
    for start, field in (
        (inference_pb2.GenerateStart(prompt=over), "prompt"),
        (
            inference_pb2.GenerateStart(messages=[common_pb2.ChatMessage(role="user", content=over)]),
            "messages",
        ),
        (inference_pb2.GenerateStart(messages=[empty] * 8193), "messages"),
    ):
        with pytest.raises(ContextTooLong) as refused:
            await start_generation(engine, start).__anext__()  # type: ignore[arg-type]
        assert refused.value.field == field and "8192-token context" in str(refused.value)


async def test_a_prompt_is_tokenized_off_the_event_loop() -> None:
    """Rendering and tokenizing held every stream of the replica (and its health checks) while
    they ran; now the loop goes on meanwhile."""
    from services.common.errors import InvalidArgument
    from services.gen.llmmesh.v1 import inference_pb2
    from services.inference.servicer import start_generation

    loop_thread = threading.get_ident()
    seen: list[int] = []

    class SlowTokenizer:
        def encode(self, text: str, **_: object) -> list[int]:
            seen.append(threading.get_ident())
            time.sleep(0.3)
            return []  # an empty prompt: refused by the engine's validation, after tokenizing

    class Engine:
        engine = SimpleNamespace(tokenizer=SlowTokenizer(), max_model_len=8192)

        def generate(self, *args: object) -> object:
            raise InvalidArgument("prompt", "is empty after tokenization")

    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        with pytest.raises(InvalidArgument):
            await start_generation(Engine(), inference_pb2.GenerateStart(prompt="hello")).__anext__()  # type: ignore[arg-type]
    finally:
        ticker.cancel()
    assert seen and seen[0] != loop_thread
    assert ticks >= 10  # the loop ran on while the prompt was tokenized
