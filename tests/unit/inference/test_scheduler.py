"""Scheduler: token budget, chunked prefill, decode priority, preemption, prefix reuse (no torch, no model).

The model runner is replaced by hand-written outputs: each step we "compute" the
scheduled chunks and append a fake token to every sequence that reached its end.
"""

from __future__ import annotations

import subprocess
import sys

from services.inference.block_manager import BlockManager
from services.inference.sampling import SamplingParams
from services.inference.scheduler import Scheduler, SchedulerOutput
from services.inference.sequence import Sequence, SequenceStatus

FAKE_TOKEN = 7


def seq(rid: str, n_prompt: int, max_tokens: int = 8, first: int = 0) -> Sequence:
    return Sequence(
        request_id=rid,
        token_ids=list(range(first, first + n_prompt)),
        num_prompt_tokens=n_prompt,
        params=SamplingParams(max_tokens=max_tokens),
    )


def fake_runner_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Apply hand-written runner outputs: every chunk computed, one fake token for finished chunks."""
    for chunk in out.scheduled:
        scheduler.advance(chunk)
        if chunk.samples:
            chunk.seq.token_ids.append(FAKE_TOKEN)
            if chunk.seq.num_output_tokens >= chunk.seq.params.max_tokens:
                scheduler.finish(chunk.seq, SequenceStatus.FINISHED_LENGTH)


def make(num_blocks: int = 64, block_size: int = 4, max_seqs: int = 8, budget: int = 32) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, block_size), max_num_seqs=max_seqs, max_num_batched_tokens=budget
    )


def test_scheduler_imports_no_torch() -> None:
    code = "import sys, services.inference.scheduler, services.inference.block_manager; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_step_never_exceeds_the_token_budget_and_long_prompts_are_chunked() -> None:
    sched = make(budget=16)
    long = seq("long", 40)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < 40:
        out = sched.schedule()
        assert out.num_batched_tokens <= 16
        chunks.append(out.scheduled[0].num_tokens)
        fake_runner_step(sched, out)
    assert chunks == [16, 16, 8]
    assert long.num_output_tokens == 1  # a token is drawn only when the last chunk ran


def test_running_decodes_are_not_stalled_by_a_long_prompt() -> None:
    sched = make(budget=16)
    short = seq("short", 4)
    sched.add(short)
    fake_runner_step(sched, sched.schedule())  # short is now decoding
    sched.add(seq("long", 100, first=1000))
    for _ in range(5):
        out = sched.schedule()
        by_id = {c.seq.request_id: c.num_tokens for c in out.scheduled}
        assert by_id["short"] == 1, "the decode runs every step"
        assert by_id["long"] == 15, "the prompt takes the rest of the budget"
        fake_runner_step(sched, out)


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched = make(max_seqs=2, budget=100)
    for i in range(4):
        sched.add(seq(f"r{i}", 3, first=10 * i))
    out = sched.schedule()
    assert [c.seq.request_id for c in out.scheduled] == ["r0", "r1"]
    assert len(sched.waiting) == 2


def test_waiting_requests_join_as_soon_as_a_running_one_finishes() -> None:
    sched = make(max_seqs=1, budget=100)
    sched.add(seq("a", 3, max_tokens=1))
    sched.add(seq("b", 3, max_tokens=1, first=50))
    fake_runner_step(sched, sched.schedule())
    assert sched.running == []
    out = sched.schedule()
    assert [c.seq.request_id for c in out.scheduled] == ["b"]


def test_out_of_blocks_preempts_the_newest_and_it_recomputes_later() -> None:
    # 6 blocks of 4 slots; two sequences of 8 prompt tokens each use 2 blocks, then grow.
    sched = make(num_blocks=6, block_size=4, budget=100)
    a, b = seq("a", 8, max_tokens=12), seq("b", 8, max_tokens=12, first=100)
    sched.add(a)
    sched.add(b)
    preempted: list[str] = []
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        preempted += [s.request_id for s in out.preempted]
        assert not out.errored
        fake_runner_step(sched, out)
    assert preempted and preempted[0] == "b", "the most recently admitted sequence yields"
    assert a.status == b.status == SequenceStatus.FINISHED_LENGTH
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert b.num_preemptions >= 1
    assert sched.block_manager.usage().used == 0


def test_a_request_that_can_never_fit_is_finished_with_an_error_not_a_hang() -> None:
    sched = make(num_blocks=2, block_size=4)
    too_big = seq("big", 12)
    sched.add(too_big)
    out = sched.schedule()
    assert out.errored == [too_big]
    assert too_big.status == SequenceStatus.FINISHED_ERROR and "KV-cache" in too_big.error
    assert not sched.has_unfinished()


def test_a_sequence_that_outgrows_the_whole_cache_alone_errors_instead_of_looping() -> None:
    sched = make(num_blocks=2, block_size=4)
    grower = seq("grower", 6, max_tokens=50)
    sched.add(grower)
    for _ in range(20):
        out = sched.schedule()
        if out.errored:
            break
        fake_runner_step(sched, out)
    assert grower.status == SequenceStatus.FINISHED_ERROR
    assert sched.block_manager.usage().used == 0


def test_prefix_reuse_skips_computing_cached_blocks() -> None:
    sched = make(num_blocks=16, block_size=4, budget=100)
    first = seq("first", 10, max_tokens=1)
    sched.add(first)
    fake_runner_step(sched, sched.schedule())
    assert first.is_finished
    second = seq("second", 10, max_tokens=1)  # same 10 prompt tokens
    sched.add(second)
    out = sched.schedule()
    assert second.num_cached_prompt_tokens == 8
    assert out.scheduled[0].start == 8 and out.scheduled[0].num_tokens == 2


def test_finish_of_a_waiting_request_releases_everything() -> None:
    sched = make(max_seqs=1)
    sched.add(seq("runs", 3))
    queued = seq("queued", 3, first=40)
    sched.add(queued)
    sched.schedule()
    sched.finish(queued, SequenceStatus.FINISHED_ABORTED)
    assert list(sched.waiting) == [] and queued.is_finished


def test_requests_arriving_together_compute_a_shared_prefix_once() -> None:
    # Three chats behind one 9-token system prompt, all waiting at once: the first
    # computes the prefix, the others reuse its two full blocks in the same step.
    sched = make(num_blocks=32, block_size=4, budget=100)
    system = list(range(100, 109))
    chats = [
        Sequence(
            request_id=f"c{i}",
            token_ids=[*system, 200 + i, 300 + i],
            num_prompt_tokens=11,
            params=SamplingParams(max_tokens=1),
        )
        for i in range(3)
    ]
    for chat in chats:
        sched.add(chat)
    out = sched.schedule()
    assert [(c.start, c.num_tokens) for c in out.scheduled] == [(0, 11), (8, 3), (8, 3)]
    assert out.num_batched_tokens == 17  # not 33
    assert [c.num_cached_prompt_tokens for c in chats] == [0, 8, 8]
    first_blocks = chats[0].block_table[:2]
    assert chats[1].block_table[:2] == first_blocks and chats[2].block_table[:2] == first_blocks
    # Each keeps its own block for the tokens where it differs.
    assert len({chats[i].block_table[2] for i in range(3)}) == 3


def test_a_decode_step_offers_no_unfilled_blocks() -> None:
    # A block a decode row completes is only offered once computed (after the step).
    sched = make(num_blocks=32, block_size=4, budget=100)
    first = seq("first", 7, max_tokens=4)
    sched.add(first)
    fake_runner_step(sched, sched.schedule())  # prefill 7 tokens, draws token 8
    twin = Sequence(
        request_id="twin",
        token_ids=[*first.token_ids, 99],
        num_prompt_tokens=9,
        params=SamplingParams(max_tokens=1),
    )
    sched.add(twin)
    out = sched.schedule()  # first decodes position 7 (fills block 1); twin is admitted
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in out.scheduled] == [
        ("first", 7, 1),
        ("twin", 4, 5),
    ]
    assert twin.num_cached_prompt_tokens == 4


def test_a_parked_sequence_gives_its_seat_and_blocks_to_the_next_and_resumes_first() -> None:
    sched = make(max_seqs=1, budget=100)
    slow_reader, other = seq("slow-reader", 8, max_tokens=20), seq("other", 8, max_tokens=2, first=100)
    sched.add(slow_reader)
    sched.add(other)
    for _ in range(3):
        fake_runner_step(sched, sched.schedule())
    assert sched.running == [slow_reader] and slow_reader.num_output_tokens == 3
    sched.park(slow_reader)
    # Out of the batch, its blocks back (the full ones stay cached), nothing left to do for it.
    assert sched.running == [] and sched.parked == {"slow-reader": slow_reader}
    assert slow_reader.block_table == [] and slow_reader.num_computed_tokens == 0
    out = sched.schedule()
    assert [c.seq.request_id for c in out.scheduled] == ["other"], "the seat went to the waiting request"
    fake_runner_step(sched, out)
    fake_runner_step(sched, sched.schedule())
    assert other.status == SequenceStatus.FINISHED_LENGTH
    assert not sched.has_unfinished(), "a parked sequence alone is no work for the engine loop"
    sched.unpark(slow_reader)
    out = sched.schedule()
    chunk = out.scheduled[0]
    assert chunk.seq is slow_reader and chunk.admitted
    assert chunk.start == 8, "its prompt's full blocks came back from the prefix cache"
    while sched.has_unfinished():
        fake_runner_step(sched, sched.schedule())
    assert slow_reader.status == SequenceStatus.FINISHED_LENGTH and slow_reader.num_output_tokens == 20
    assert sched.block_manager.usage().used == 0


def test_a_parked_sequence_can_still_be_finished_and_park_is_idempotent() -> None:
    sched = make()
    a, b = seq("a", 4), seq("b", 4, first=100)
    sched.add(a)
    sched.add(b)
    sched.park(b)  # parked while still waiting: it held no blocks
    sched.park(b)
    assert list(sched.waiting) == [a] and sched.parked == {"b": b}
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert sched.parked == {} and b.is_finished
    sched.park(b)  # a finished sequence is never parked again
    sched.unpark(b)  # nor scheduled again
    assert sched.parked == {} and list(sched.waiting) == [a]
