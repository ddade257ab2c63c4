"""GenerateMany over a real socket: many generations on one stream, batched per step, failing alone.

The server half is ``serve_many`` over the synthetic token source (a load-test
tool, no model) stepping like an engine; the client half is ``ReplicaMultiplexer``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common.generate_many.client import GenerationHandle, ReplicaMultiplexer, StreamBroken
from services.common.generate_many.limits import MERGE_PENDING_AFTER, MESSAGE_BUDGET_BYTES, PAUSE_AFTER_TOKENS
from services.common.generate_many.server import serve_many
from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.synthetic.config import SyntheticConfig
from services.synthetic.replica import SyntheticInference
from services.synthetic.tokens import prompt_key, synthetic_token


def start_of(text: str, max_tokens: int) -> inference_pb2.GenerateStart:
    return inference_pb2.GenerateStart(
        request_id=text, prompt=text, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)
    )


def expected(start: inference_pb2.GenerateStart) -> list[int]:
    key = prompt_key(start)
    return [synthetic_token(key, i) for i in range(start.sampling.max_tokens)]


class Replica:
    """A synthetic replica on a real port, in this process."""

    def __init__(self, config: SyntheticConfig) -> None:
        self.servicer = SyntheticInference(config)
        self.server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(self.servicer, self.server)  # type: ignore[no-untyped-call]
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)  # type: ignore[no-untyped-call]

    async def __aenter__(self) -> Replica:
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close(None)
        await self.server.stop(None)


async def collect(mux: ReplicaMultiplexer, start: inference_pb2.GenerateStart, timeout_s: float = 0.0):  # type: ignore[no-untyped-def]
    """(token ids, the batches' sizes, the last event) of one generation."""
    handle = mux.open(start, timeout_s)
    ids: list[int] = []
    sizes: list[int] = []
    try:
        while True:
            events = await handle.events()
            sizes.append(len(events))
            for event in events:
                if event.HasField("chunk"):
                    ids.extend(event.chunk.token_ids)
                else:
                    return ids, sizes, event
    finally:
        handle.close()


async def test_a_step_of_every_generation_travels_as_one_message() -> None:
    async with Replica(SyntheticConfig(step_s=0.02)) as replica:
        starts = [start_of(f"prompt {i}", 10) for i in range(8)]

        async def requests() -> AsyncIterator[inference_pb2.GenerateManyRequest]:
            for tag, start in enumerate(starts, 1):
                yield inference_pb2.GenerateManyRequest(tag=tag, start=start)

        tokens: dict[int, list[int]] = {tag: [] for tag in range(1, 9)}
        messages = 0
        async for response in replica.stub.GenerateMany(requests()):
            messages += 1
            for event in response.events:
                if event.HasField("chunk"):
                    assert event.chunk.index == len(tokens[event.tag])
                    tokens[event.tag].extend(event.chunk.token_ids)
        assert tokens == {tag: expected(start) for tag, start in enumerate(starts, 1)}
        # 8 generations × (10 chunks + finished) = 88 events; one message per step, not one per event.
        assert messages <= 14


async def test_generations_share_one_stream_and_each_gets_exactly_its_tokens() -> None:
    async with Replica(SyntheticConfig(step_s=0.005)) as replica:
        mux = ReplicaMultiplexer(replica.stub, "test")
        starts = [start_of(f"q{i}", 12 + i) for i in range(6)]
        results = await asyncio.gather(*(collect(mux, s) for s in starts))
        for start, (ids, _, last) in zip(starts, results, strict=True):
            assert ids == expected(start)
            assert last.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert mux.generations == 0
        await mux.close()


async def test_a_slow_consumer_gets_what_piled_up_as_one_batch_in_order() -> None:
    async with Replica(SyntheticConfig()) as replica:  # unpaced: tokens arrive faster than read
        mux = ReplicaMultiplexer(replica.stub, "test")
        start = start_of("slow reader", 200)
        handle = mux.open(start, 0.0)
        ids: list[int] = []
        batches = 0
        while True:
            events = await handle.events()
            batches += 1
            chunks = [e.chunk for e in events if e.HasField("chunk")]
            for c in chunks:
                assert c.index == len(ids)  # numbered in order, none lost or repeated
                ids.extend(c.token_ids)
            if events[-1].HasField("finished"):
                break
            await asyncio.sleep(0.01)  # a client that writes slowly
        handle.close()
        assert ids == expected(start)
        assert batches < 100
        await mux.close()


async def settled_tokens(replica: Replica) -> int:
    """Tokens the replica sent once it stopped sending (paused, or done)."""
    seen = -1
    while seen != replica.servicer.tokens_sent:
        seen = replica.servicer.tokens_sent
        await asyncio.sleep(0.1)
    return seen


async def test_a_consumer_that_stops_taking_events_pauses_its_generation_and_holds_it_merged() -> None:
    async with Replica(SyntheticConfig()) as replica:  # unpaced: 6,000 tokens would arrive at once
        mux = ReplicaMultiplexer(replica.stub, "test")
        start = start_of("never read", 6000)
        handle = mux.open(start, 0.0)
        sent = await settled_tokens(replica)
        # Paused on the replica soon after PAUSE_AFTER_TOKENS: the router holds a bounded share.
        assert PAUSE_AFTER_TOKENS <= sent < 3 * PAUSE_AFTER_TOKENS, sent
        assert replica.servicer.running == 1
        assert len(handle._events) <= MERGE_PENDING_AFTER
        ids: list[int] = []
        text: list[str] = []
        while True:  # taking the events resumes it; the rest follows, in order, none lost
            events = await handle.events()
            for event in events:
                if event.HasField("chunk"):
                    assert event.chunk.index == len(ids)
                    ids.extend(event.chunk.token_ids)
                    text.append(event.chunk.text)
            if events[-1].HasField("finished"):
                break
        assert ids == expected(start)
        assert "".join(text) == "".join(f" t{t}" for t in expected(start))
        handle.close()
        await mux.close()


async def test_a_paused_generation_leaves_the_others_on_the_stream_flowing() -> None:
    async with Replica(SyntheticConfig(step_s=0.002)) as replica:
        mux = ReplicaMultiplexer(replica.stub, "test")
        stuck = mux.open(start_of("stuck", 8000), 0.0)
        while replica.servicer.tokens_sent < PAUSE_AFTER_TOKENS:
            await asyncio.sleep(0.05)
        await settled_tokens(replica)  # only the paused one runs: nothing more comes
        ids, _, last = await collect(mux, start_of("healthy", 50))
        assert ids == expected(start_of("healthy", 50)) and last.HasField("finished")
        stuck.close()  # cancels the paused generation on the replica
        for _ in range(100):
            if replica.servicer.running == 0:
                break
            await asyncio.sleep(0.01)
        assert replica.servicer.running == 0
        await mux.close()


async def test_one_generations_error_leaves_the_others_running() -> None:
    async with Replica(SyntheticConfig(step_s=0.005)) as replica:
        mux = ReplicaMultiplexer(replica.stub, "test")
        bad = inference_pb2.GenerateStart(
            request_id="bad", prompt="x", sampling=common_pb2.SamplingParams(max_tokens=0)
        )
        good = start_of("fine", 20)
        (_, _, error), (ids, _, last) = await asyncio.gather(collect(mux, bad), collect(mux, good))
        assert error.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "max_tokens" in error.error.message
        assert ids == expected(good) and last.HasField("finished")
        await mux.close()


async def test_a_start_too_big_for_a_message_is_refused_and_the_others_keep_their_stream() -> None:
    """Sent, a GenerateStart over gRPC's message limit ended the shared stream for every
    generation on it (and then on the next replica, where the router retried it)."""
    from services.common import errors
    from services.common.generate_many.limits import MAX_START_BYTES

    async with Replica(SyntheticConfig(step_s=0.005)) as replica:
        mux = ReplicaMultiplexer(replica.stub, "test")
        good = start_of("fine", 40)
        running = asyncio.create_task(collect(mux, good))
        await asyncio.sleep(0.05)
        huge = start_of("x" * (MAX_START_BYTES + 1), 5)
        with pytest.raises(errors.InvalidArgument) as refused:
            mux.open(huge, 0.0)
        assert refused.value.field == "prompt"
        ids, _, last = await running
        assert ids == expected(good) and last.HasField("finished")
        await mux.close()


async def test_the_synthetic_replica_refuses_more_tokens_than_its_context_as_the_engine_does() -> None:
    async with Replica(SyntheticConfig()) as replica:
        info = await replica.stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
        mux = ReplicaMultiplexer(replica.stub, "test")
        huge = start_of("a prompt", 2**31 - 1)
        fits = start_of("the whole context less the prompt", info.max_context_tokens - 8)
        (_, _, error), (ids, _, last) = await asyncio.gather(collect(mux, huge), collect(mux, fits))
        await mux.close()

    assert error.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "max_tokens" in error.error.message and "8192-token context" in error.error.message
    assert ids == expected(fits) and last.HasField("finished")


async def test_the_synthetic_replicas_context_can_be_set_and_is_what_it_advertises() -> None:
    with pytest.raises(ValueError, match="--max-context-tokens"):
        SyntheticConfig(max_context_tokens=1)
    async with Replica(SyntheticConfig(max_context_tokens=64)) as replica:
        info = await replica.stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
        mux = ReplicaMultiplexer(replica.stub, "test")
        (_, _, error), (ids, _, _) = await asyncio.gather(
            collect(mux, start_of("a prompt", 63)), collect(mux, start_of("a prompt", 62))
        )
        await mux.close()

    assert info.max_context_tokens == 64
    assert "64-token context" in error.error.message
    assert len(ids) == 62


async def test_a_generation_past_its_timeout_fails_with_deadline_exceeded() -> None:
    async with Replica(SyntheticConfig(tokens_per_second=20)) as replica:
        mux = ReplicaMultiplexer(replica.stub, "test")
        ids, _, last = await collect(mux, start_of("too long", 100), timeout_s=0.2)
        assert last.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert 1 <= len(ids) <= 6
        assert replica.servicer.running == 0
        await mux.close()


async def test_closing_a_handle_cancels_that_generation_on_the_replica_only() -> None:
    async with Replica(SyntheticConfig(tokens_per_second=50)) as replica:
        mux = ReplicaMultiplexer(replica.stub, "test")
        keep = asyncio.create_task(collect(mux, start_of("keep", 15)))
        dropped = mux.open(start_of("drop", 1000), 0.0)
        await dropped.events()
        assert replica.servicer.running == 2
        dropped.close()
        for _ in range(100):
            if replica.servicer.running == 1:
                break
            await asyncio.sleep(0.01)
        assert replica.servicer.running == 1
        ids, _, last = await keep
        assert ids == expected(start_of("keep", 15)) and last.HasField("finished")
        await mux.close()


async def test_a_broken_stream_fails_every_generation_and_the_next_open_dials_again() -> None:
    replica = Replica(SyntheticConfig(tokens_per_second=50))
    await replica.server.start()
    mux = ReplicaMultiplexer(replica.stub, "test")
    handles = [mux.open(start_of(f"long {i}", 1000), 0.0) for i in range(3)]
    for h in handles:
        await h.events()
    await replica.server.stop(None)  # the replica goes away mid-stream
    for h in handles:
        with pytest.raises(StreamBroken):
            while True:
                await h.events()
    # A new replica on the same port: the next generation opens a fresh stream there.
    again = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(SyntheticInference(SyntheticConfig()), again)  # type: ignore[no-untyped-call]
    again.add_insecure_port(f"127.0.0.1:{replica.port}")
    await again.start()
    try:
        ids, _, last = await collect(mux, start_of("after", 5))
        assert ids == expected(start_of("after", 5)) and last.HasField("finished")
    finally:
        await mux.close()
        await replica.channel.close(None)
        await again.stop(None)


async def test_a_step_larger_than_the_message_budget_is_split_none_lost() -> None:
    class Big:
        """A backend whose generations each send one 300 KiB chunk at once."""

        async def generate(self, start: inference_pb2.GenerateStart, timeout_s: float):  # type: ignore[no-untyped-def]
            yield inference_pb2.GenerationEvent(
                chunk=inference_pb2.TokenChunk(text=start.prompt * 300 * 1024)
            )
            yield inference_pb2.GenerationEvent(finished=inference_pb2.GenerationFinished())

        def cancel(self, request_id: str) -> None:
            pass

    async def requests() -> AsyncIterator[inference_pb2.GenerateManyRequest]:
        for tag in range(1, 9):
            yield inference_pb2.GenerateManyRequest(tag=tag, start=inference_pb2.GenerateStart(prompt="x"))

    messages = [m async for m in serve_many(Big(), requests())]
    assert len(messages) >= 3
    assert all(m.ByteSize() <= MESSAGE_BUDGET_BYTES + 400 * 1024 for m in messages)
    events = [e for m in messages for e in m.events]
    assert sorted(e.tag for e in events if e.HasField("chunk")) == list(range(1, 9))
    assert sorted(e.tag for e in events if e.HasField("finished")) == list(range(1, 9))


async def test_a_tag_already_running_is_refused_on_its_own() -> None:
    async with Replica(SyntheticConfig(tokens_per_second=100)) as replica:

        async def requests() -> AsyncIterator[inference_pb2.GenerateManyRequest]:
            yield inference_pb2.GenerateManyRequest(tag=7, start=start_of("first", 5))
            yield inference_pb2.GenerateManyRequest(tag=7, start=start_of("second", 5))

        events = [e async for r in replica.stub.GenerateMany(requests()) for e in r.events]
        errors = [e for e in events if e.HasField("error")]
        assert len(errors) == 1 and "already running" in errors[0].error.message
        assert sum(len(e.chunk.token_ids) for e in events if e.HasField("chunk")) == 5


class Counting:
    """A backend whose generations yield one-token chunks (forever, or ``limit`` of them), counting
    what was taken from it."""

    def __init__(self, limit: int | None = None) -> None:
        self.taken = 0
        self.limit = limit
        self.cancelled: set[str] = set()

    async def generate(self, start: inference_pb2.GenerateStart, timeout_s: float):  # type: ignore[no-untyped-def]
        index = 0
        while start.request_id not in self.cancelled and index != self.limit:
            self.taken += 1
            yield inference_pb2.GenerationEvent(
                chunk=inference_pb2.TokenChunk(index=index, token_ids=[index])
            )
            index += 1
            await asyncio.sleep(0)
        yield inference_pb2.GenerationEvent(
            finished=inference_pb2.GenerationFinished(finish_reason=common_pb2.FINISH_REASON_CANCELLED)
        )

    def cancel(self, request_id: str) -> None:
        self.cancelled.add(request_id)


async def test_pause_stops_taking_from_the_backend_until_resume_and_cancel_ends_a_paused_one() -> None:
    backend = Counting()
    inbox: asyncio.Queue[inference_pb2.GenerateManyRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[inference_pb2.GenerateManyRequest]:
        while (request := await inbox.get()) is not None:
            yield request

    def ask(**action: object) -> None:
        inbox.put_nowait(inference_pb2.GenerateManyRequest(tag=1, **action))  # type: ignore[arg-type]

    stream = serve_many(backend, requests())
    ask(start=inference_pb2.GenerateStart(request_id="r"))
    await anext(stream)
    ask(pause=inference_pb2.PauseGeneration())
    for _ in range(5):
        await asyncio.sleep(0.01)
    paused_at = backend.taken
    await asyncio.sleep(0.05)
    assert backend.taken == paused_at  # nothing taken while paused
    ask(resume=inference_pb2.ResumeGeneration())
    ask(pause=inference_pb2.PauseGeneration())
    await asyncio.sleep(0.05)
    assert backend.taken > paused_at  # resumed, then paused again
    ask(cancel=inference_pb2.CancelGeneration())
    inbox.put_nowait(None)  # half-close: the stream ends once the generation does
    events = [e for m in [m async for m in stream] for e in m.events]
    assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_CANCELLED


async def test_a_router_behind_on_the_stream_holds_back_every_generation_not_just_the_writer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The stream's flow control stops the writer; without a bound the generations kept making
    # their answers into the outbox, and a `pause` arrived after the whole answer was queued.
    from services.common.generate_many import server

    bound = 512  # OUTBOX_EVENTS' behaviour at a size this test fills in milliseconds
    monkeypatch.setattr(server, "OUTBOX_EVENTS", bound)
    backend = Counting()
    inbox: asyncio.Queue[inference_pb2.GenerateManyRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[inference_pb2.GenerateManyRequest]:
        while (request := await inbox.get()) is not None:
            yield request

    for tag in range(1, 5):
        inbox.put_nowait(
            inference_pb2.GenerateManyRequest(
                tag=tag, start=inference_pb2.GenerateStart(request_id=f"r{tag}")
            )
        )
    stream = serve_many(backend, requests())
    first = await anext(stream)  # then the router takes nothing for a while
    for _ in range(50):
        await asyncio.sleep(0.005)
    held = backend.taken - len(first.events)
    assert bound <= held <= bound + 4, held  # one more event per generation at most
    taken = backend.taken
    await asyncio.sleep(0.05)
    assert backend.taken == taken  # nothing more while the router reads nothing
    second = await anext(stream)  # the router reads: the generations go on
    for _ in range(5):
        await asyncio.sleep(0.005)
    assert backend.taken > taken and second.events
    for tag in range(1, 5):
        inbox.put_nowait(inference_pb2.GenerateManyRequest(tag=tag, cancel=inference_pb2.CancelGeneration()))
    inbox.put_nowait(None)
    ends = [e for m in [m async for m in stream] for e in m.events if e.HasField("finished")]
    assert len(ends) == 4  # each ends (CANCELLED) once the router reads again


async def test_a_paused_generation_still_times_out() -> None:
    async def requests() -> AsyncIterator[inference_pb2.GenerateManyRequest]:
        yield inference_pb2.GenerateManyRequest(
            tag=1, start=inference_pb2.GenerateStart(request_id="r"), timeout_s=0.2
        )
        yield inference_pb2.GenerateManyRequest(tag=1, pause=inference_pb2.PauseGeneration())

    events = [e async for m in serve_many(Counting(), requests()) for e in m.events]
    assert events[-1].error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


async def test_time_spent_on_a_slow_client_is_not_a_replica_stall() -> None:
    from services.router.placement.policies import AffinityPolicy, LeastOutstandingPolicy
    from services.router.placement.pool import ReplicaPool
    from services.router.placement.request import PlacementRequest
    from services.router.streams.relay import Relay, RelayConfig, RelayOutcome

    async with Replica(SyntheticConfig(tokens_per_second=100)) as replica:
        pool = ReplicaPool(ReplicaMultiplexer)
        pool.set_addresses([f"127.0.0.1:{replica.port}"])
        try:
            for r in pool.replicas.values():
                r.model, r.serving = "synthetic", True
            relay = Relay(
                pool,
                AffinityPolicy(LeastOutstandingPolicy()),
                # Timeouts far above the replica's 10 ms a token, so a loaded 2-vCPU run does not
                # stall the replica itself: what is under test is the client's own 2x slowness.
                RelayConfig(ttft_timeout_s=0.5, stall_timeout_s=0.5),
            )
            start = start_of("slow client", 150)
            outcome = RelayOutcome()
            ids: list[int] = []
            batches = 0
            async for batch in relay.generate(start, PlacementRequest(["synthetic"]), outcome):
                ids.extend(t for chunk in batch for t in chunk.token_ids)
                batches += 1
                if batches <= 2:
                    await asyncio.sleep(1.0)  # the client takes twice the stall timeout to take a batch
            # The replica sent tokens all along: no stall, no failover, nothing lost.
            assert ids == expected(start)
            assert (outcome.failovers, outcome.retries) == (0, 0)
            assert outcome.finished is not None
        finally:
            await pool.close()


async def test_a_paused_generation_flows_again_once_the_client_half_closes() -> None:
    async def requests() -> AsyncIterator[inference_pb2.GenerateManyRequest]:
        yield inference_pb2.GenerateManyRequest(tag=1, start=inference_pb2.GenerateStart(request_id="r"))
        yield inference_pb2.GenerateManyRequest(tag=1, pause=inference_pb2.PauseGeneration())
        # Half-closed here: no resume can come, so the generation must not stay paused forever.

    async with asyncio.timeout(5):
        events = [e async for m in serve_many(Counting(limit=200), requests()) for e in m.events]
    assert [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids] == list(range(200))
    assert events[-1].HasField("finished")


class _HeldCall:
    """A GenerateMany call whose writes complete only when the test says so (no replica)."""

    def __init__(self) -> None:
        self.started: list[inference_pb2.GenerateManyRequest] = []
        self.acks: list[asyncio.Future[None]] = []
        self.cancelled = False
        self._closed = asyncio.Event()

    async def write(self, request: inference_pb2.GenerateManyRequest) -> None:
        self.started.append(request)
        ack = asyncio.get_running_loop().create_future()
        self.acks.append(ack)
        await ack

    def __aiter__(self) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
        await self._closed.wait()
        return
        yield  # an async generator that ends when the call is cancelled

    def cancel(self) -> bool:
        self.cancelled = True
        self._closed.set()
        return True


class _HeldStub:
    def __init__(self) -> None:
        self.call = _HeldCall()

    def GenerateMany(self) -> _HeldCall:
        return self.call


async def test_an_idle_streams_request_goes_out_before_open_returns_and_later_ones_follow_in_order() -> None:
    stub = _HeldStub()
    mux = ReplicaMultiplexer(stub, "held")  # type: ignore[arg-type]
    first = mux.open(start_of("first", 4), None)
    # No loop turn yet: the write already started on this stack (no writer task to schedule).
    assert [r.start.request_id for r in stub.call.started] == ["first"]
    second = mux.open(start_of("second", 4), None)
    first.close()  # a cancel, queued behind the second start
    await asyncio.sleep(0)
    assert len(stub.call.started) == 1  # one write in flight at a time, as grpc aio requires
    stub.call.acks[0].set_result(None)
    await asyncio.sleep(0)
    stub.call.acks[1].set_result(None)
    await asyncio.sleep(0)
    kinds = [f"{r.WhichOneof('action')}:{r.tag}" for r in stub.call.started]
    assert kinds == [f"start:{first.tag}", f"start:{second.tag}", f"cancel:{first.tag}"]
    stub.call.acks[2].set_result(None)
    await asyncio.sleep(0)
    # Idle again: the next request is written at once, by a fresh eager start.
    mux.open(start_of("third", 4), None)
    assert stub.call.started[-1].start.request_id == "third"
    await mux.close()
    assert stub.call.cancelled


async def test_generate_runs_the_same_generation_on_the_shared_path_and_names_an_unnamed_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmmesh.synthetic")
    async with Replica(SyntheticConfig(log_requests=True)) as replica:
        start = inference_pb2.GenerateStart(prompt="direct", sampling=common_pb2.SamplingParams(max_tokens=9))
        call = replica.stub.Generate(iter([inference_pb2.GenerateRequest(start=start)]), timeout=10)
        responses = [r async for r in call]
        mux = ReplicaMultiplexer(replica.stub, "test")
        ids, _, last = await collect(mux, start_of("direct", 9))
        await mux.close()
    assert [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids] == expected(start) == ids
    assert responses[-1].finished.usage == last.finished.usage
    assert replica.servicer.running == 0
    logged = [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("generate ")]
    assert re.fullmatch(r"request_id=[0-9a-f]{32}", logged[0])  # minted by the replica: none was sent
    assert logged[1] == "request_id=direct"  # the caller's, carried unchanged


def test_chunks_merged_for_a_slow_consumer_keep_the_first_chunks_prompt_logprobs() -> None:
    scored = [common_pb2.TokenLogprobs(logprob=-0.5, text="The"), common_pb2.TokenLogprobs(logprob=-2.0)]
    handle = GenerationHandle(None, 1)  # type: ignore[arg-type]  # no connection: never paused here
    handle._events = [
        inference_pb2.GenerationEvent(
            tag=1,
            chunk=inference_pb2.TokenChunk(
                text="a",
                token_ids=[7],
                index=0,
                prompt_logprobs=scored,
                prompt_text="The 世",
                prompt_tokens=2,
            ),
        ),
        inference_pb2.GenerationEvent(
            tag=1, chunk=inference_pb2.TokenChunk(text="b", token_ids=[8], index=1)
        ),
    ]
    handle._merge_pending()
    (merged,) = handle._events
    assert list(merged.chunk.token_ids) == [7, 8] and merged.chunk.text == "ab"
    assert list(merged.chunk.prompt_logprobs) == scored
    assert merged.chunk.prompt_text == "The 世"  # what an echo shows, kept whole
    assert merged.chunk.prompt_tokens == 2  # what a cancelled turn's prompt cost
