"""AsyncEngine streaming: a reader that falls behind gets what piled up as one output, none lost."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
from types import SimpleNamespace

import pytest

from services.common import errors
from services.inference.async_engine import AsyncEngine, merge_outputs
from services.inference.outputs import EngineLoad, RequestOutput, SampledToken, Timings, Usage
from services.inference.sampling import Constraint, ConstraintKind, SamplingParams
from services.inference.sequence import FinishReason


class FakeTokenEngine:
    """Stands in for LLMEngine (no model): one token per step for its one request, as fast as it can.

    With ``fail_after`` the step after that many tokens raises, as a broken model step would.
    """

    def __init__(self, tokens: int, fail_after: int | None = None) -> None:
        self.config = SimpleNamespace(max_queued_requests=8)
        self.num_preemptions = 0
        self.tokens = tokens
        self.fail_after = fail_after
        self.sent = 0
        self.request_id: str | None = None
        self.all_sent = threading.Event()

    def load(self) -> EngineLoad:
        return EngineLoad(0, 1 if self.request_id else 0, 0, 16, 0, 0.0)

    def validate(
        self, prompt: list[int], params: SamplingParams, resume: object, prompt_field: str = "prompt"
    ) -> None:
        return None

    def check_room(self, waiting: int) -> None:
        return None

    def enqueue(
        self, request_id: str, prompt: list[int], params: SamplingParams, resume: object, **made: object
    ) -> None:
        self.request_id = request_id

    def abort_request(self, request_id: str) -> None:
        self.request_id = None

    def reset_prefix_cache(self) -> None:
        return None

    def has_unfinished_requests(self) -> bool:
        return self.request_id is not None

    def step(self) -> list[RequestOutput]:
        if self.request_id is None:
            return []
        if self.fail_after is not None and self.sent == self.fail_after:
            self.all_sent.set()
            raise RuntimeError("model step failed")
        i = self.sent
        self.sent += 1
        if self.sent < self.tokens:
            return [RequestOutput(self.request_id, [100 + i], f" w{i}", i)]
        rid, self.request_id = self.request_id, None
        self.all_sent.set()
        return [
            RequestOutput(
                rid,
                [100 + i],
                f" w{i}",
                i,
                finished=True,
                finish_reason=FinishReason.LENGTH,
                usage=Usage(prompt_tokens=3, completion_tokens=self.tokens, cached_prompt_tokens=0),
                timings=Timings(total_ms=1.0),
            )
        ]


async def read_slowly(engine: AsyncEngine, fake: FakeTokenEngine, got: list[RequestOutput]) -> None:
    stream = engine.generate("r1", [1, 2, 3], SamplingParams(max_tokens=fake.tokens))
    async for out in stream:
        got.append(out)
        # The servicer is still writing this message: everything else the engine makes meanwhile queues up.
        await asyncio.to_thread(fake.all_sent.wait, 5.0)


async def test_a_reader_that_falls_behind_gets_the_piled_up_tokens_as_one_output() -> None:
    fake = FakeTokenEngine(tokens=20)
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    got: list[RequestOutput] = []
    try:
        await read_slowly(engine, fake, got)
    finally:
        engine.close()
    assert [t for o in got for t in o.new_token_ids] == [100 + i for i in range(20)]
    assert "".join(o.text for o in got) == "".join(f" w{i}" for i in range(20))
    assert len(got) < 20  # merged: fewer messages than tokens
    position = 0
    for out in got:  # each output's index is where its first token sits in the answer
        assert out.index == position
        position += len(out.new_token_ids)
    assert got[-1].finished and got[-1].finish_reason == FinishReason.LENGTH
    assert got[-1].usage is not None and got[-1].usage.completion_tokens == 20
    assert not any(o.finished for o in got[:-1])


async def test_an_engine_failure_reaches_the_reader_after_the_tokens_before_it() -> None:
    fake = FakeTokenEngine(tokens=20, fail_after=5)
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    got: list[RequestOutput] = []
    try:
        with pytest.raises(errors.DependencyUnavailable, match="engine failed"):
            await read_slowly(engine, fake, got)
    finally:
        engine.close()
    assert [t for o in got for t in o.new_token_ids] == [100 + i for i in range(5)]


class RefusingEngine(FakeTokenEngine):
    """Refuses every request: on arrival (``check_room``: a full waiting queue) or as the engine thread
    queues it (``enqueue``: the id raced another request's)."""

    def __init__(self, where: str) -> None:
        super().__init__(tokens=1)
        self.where = where
        self.aborted: list[str] = []

    def check_room(self, waiting: int) -> None:
        if self.where == "admit":
            raise errors.Overloaded("waiting queue is full (8 requests); retry later", retry_after_s=1.0)

    def enqueue(
        self, request_id: str, prompt: list[int], params: SamplingParams, resume: object, **made: object
    ) -> None:
        raise errors.Overloaded("waiting queue is full (8 requests); retry later", retry_after_s=1.0)

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.mark.parametrize("where", ["admit", "enqueue"])
async def test_a_refusal_of_the_engine_reaches_the_caller_and_aborts_nothing(where: str) -> None:
    # The queue bound and validation live in LLMEngine.admit alone; a stray abort for the
    # refused id would cancel a retry that reuses it.
    fake = RefusingEngine(where)
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    try:
        with pytest.raises(errors.Overloaded, match="queue is full") as refused:
            async for _ in engine.generate("r1", [1, 2, 3], SamplingParams(max_tokens=1)):
                pass
    finally:
        engine.close()
    assert refused.value.retry_after_s == 1.0
    assert fake.aborted == []


def test_merge_keeps_the_first_index_and_the_last_outputs_end() -> None:
    outs = [
        RequestOutput("r", [7], "a", 4, prompt_tokens=12),  # the first output says the prompt's size
        RequestOutput("r", [8], "", 5),  # a token whose text is still held back by the detokenizer
        RequestOutput("r", [9], "bc", 6, finished=True, finish_reason=FinishReason.STOP, matched_stop="c"),
    ]
    merged = merge_outputs(outs)
    assert (merged.new_token_ids, merged.text, merged.index) == ([7, 8, 9], "abc", 4)
    assert merged.finished and merged.finish_reason == FinishReason.STOP and merged.matched_stop == "c"
    assert merged.prompt_tokens == 12
    assert merge_outputs(outs[:1]) is outs[0]


def test_merge_keeps_the_first_outputs_prompt_logprobs() -> None:
    scored = (SampledToken(3, math.nan), SampledToken(5, -1.5, ((5, -1.5),)))
    outs = [
        RequestOutput("r", [7], "a", 0, prompt_logprobs=scored),
        RequestOutput("r", [8], "b", 1, finished=True, finish_reason=FinishReason.LENGTH),
    ]
    assert merge_outputs(outs).prompt_logprobs == scored


class PreparingEngine(FakeTokenEngine):
    """Prepares a resumed request slowly (``make_detokenizer`` waits for ``ready``, as a long resume
    or a grammar compile takes seconds), records the aborts it gets, and ends an aborted request
    with its CANCELLED output at the next step, as LLMEngine does; ``faulty`` ends it with a fault."""

    def __init__(self, faulty: bool = False) -> None:
        super().__init__(tokens=50)
        self.ready = threading.Event()
        self.preparing = threading.Event()
        self.faulty = faulty
        self.aborted: list[str] = []
        self.ending: str | None = None

    def make_detokenizer(self, params: SamplingParams, resume: object) -> object:
        self.preparing.set()
        self.ready.wait(5.0)
        return object()

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if request_id == self.request_id:
            self.ending, self.request_id = request_id, None

    def has_unfinished_requests(self) -> bool:
        return self.ending is not None or super().has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        if self.ending is not None:
            rid, self.ending = self.ending, None
            return [RequestOutput(rid, [], "", 0, finished=True, finish_reason=FinishReason.CANCELLED)]
        if self.faulty and self.request_id is not None:
            rid, self.request_id = self.request_id, None
            failed = RequestOutput(rid, [], "", 0, finished=True, finish_reason=FinishReason.ERROR)
            return [dataclasses.replace(failed, fault=True, error="the row's logits were NaN")]
        return super().step()


async def test_a_cancel_while_the_request_is_prepared_ends_it_cancelled() -> None:
    """A cancel that came while the request was prepared (before the engine had it) was lost:
    the request then ran to its end. It is kept and applied at the handover."""
    fake = PreparingEngine()
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    got: list[RequestOutput] = []

    async def read() -> None:
        async for out in engine.generate("r1", [1, 2, 3], SamplingParams(max_tokens=50), [7]):
            got.append(out)

    try:
        reading = asyncio.create_task(read())
        await asyncio.to_thread(fake.preparing.wait, 5.0)
        engine.abort("r1")  # the servicer's cancel
        fake.ready.set()
        await asyncio.wait_for(reading, 10)
    finally:
        engine.close()
    assert got and got[-1].finish_reason == FinishReason.CANCELLED
    assert sum(len(o.new_token_ids) for o in got) == 0
    assert fake.aborted == ["r1"]


async def test_a_request_the_engine_ended_with_a_fault_is_not_aborted_after() -> None:
    """Its id is the engine's no more: an abort sent for it would wait in the engine's queue and
    cancel a retry that reuses the id."""
    fake = PreparingEngine(faulty=True)
    fake.ready.set()
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    try:
        with pytest.raises(errors.RequestFault, match="NaN"):
            async for _ in engine.generate("r1", [1, 2, 3], SamplingParams(max_tokens=50)):
                pass
    finally:
        engine.close()
    assert fake.aborted == []


class CompilingEngine(FakeTokenEngine):
    """Compiles every new grammar slowly (``make_guide`` waits for ``compiled``, as a schema of
    hundreds of patternProperties takes seconds to minutes): none is ever in the cache."""

    def __init__(self) -> None:
        super().__init__(tokens=3)
        self.compiled = threading.Event()
        self.compiling = 0
        self.lock = threading.Lock()

    def grammar_compiled(self, params: SamplingParams) -> bool:
        return params.constraint is None

    def make_guide(self, params: SamplingParams, resume: object) -> object:
        with self.lock:
            self.compiling += 1
        self.compiled.wait(10.0)
        return object()

    def make_detokenizer(self, params: SamplingParams, resume: object) -> object:
        return object()


async def test_slow_grammar_compiles_do_not_hold_up_other_requests_preparation() -> None:
    """New grammars compile on their own thread, one at a time: eight slow compiles held every
    thread of the default executor, and a resumed request (its text replayed there) waited."""
    fake = CompilingEngine()
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    constrained = SamplingParams(max_tokens=3, constraint=Constraint(ConstraintKind.JSON_OBJECT))

    async def drain(request_id: str, params: SamplingParams, resume: list[int]) -> list[RequestOutput]:
        return [out async for out in engine.generate(request_id, [1, 2, 3], params, resume)]

    compiles = [asyncio.create_task(drain(f"schema-{i}", constrained, [])) for i in range(8)]
    try:
        await asyncio.sleep(0.2)
        assert fake.compiling == 1  # one at a time, on the grammar thread
        resumed = await asyncio.wait_for(drain("resumed", SamplingParams(max_tokens=3), [7]), 5)
        assert resumed[-1].finished
    finally:
        for task in compiles:
            task.cancel()
        fake.compiled.set()
        await asyncio.gather(*compiles, return_exceptions=True)
        engine.close()


async def test_an_idle_engines_throughput_falls_to_zero_after_its_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An idle engine takes no steps, so its last published load stood for ever: a replica that
    made 40 tokens reported 8 tok/s after minutes idle, which placement reads as busy."""
    from services.inference import async_engine

    fake = FakeTokenEngine(tokens=3)
    fake.load = lambda: EngineLoad(0, 0, 0, 16, 0, 8.0)  # type: ignore[method-assign]
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    try:
        assert engine.load().tokens_per_second == 8.0
        later = async_engine.time.monotonic() + async_engine.THROUGHPUT_WINDOW_S + 0.1
        monkeypatch.setattr(async_engine.time, "monotonic", lambda: later)
        assert engine.load().tokens_per_second == 0.0
    finally:
        monkeypatch.undo()
        engine.close()
