"""--compile on CPU: a pure decode step over the slab runs as one graph compiled at warm-up.

A tiny Llama (random weights, two layers) keeps the compile short; the graph must give
the eager forward's hidden states and write the same K/V into the paged cache and the
slab, at row counts and slab lengths it was not traced with (a single row too, padded to
two), without compiling again. Steps it does not cover (prefill, mixed) run eagerly.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.inference import compiled_decode, llama
from services.inference.decode_slab import DecodeSlab
from services.inference.flat_batch import FlatBatchBuilder

BLOCK, BLOCKS, MAX_ROWS = 4, 256, 8
CPU = torch.device("cpu")


class Replica:
    """The parts of a CPU replica the decode step touches: forward, paged cache, slab."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=96,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
        self.forward = llama.LlamaForward(LlamaForCausalLM(config).eval(), 512, keep_weights=True)
        kv, dim = self.forward.num_kv_heads, self.forward.head_dim
        self.pad_slot = BLOCKS * BLOCK
        # Random past K/V: every row attends over real-looking history.
        self.k = [torch.randn(kv, self.pad_slot + 1, dim) for _ in range(2)]
        self.v = [torch.randn(kv, self.pad_slot + 1, dim) for _ in range(2)]
        self.slab = DecodeSlab(2, MAX_ROWS, BLOCK, kv, dim, torch.float32, CPU, 1 << 30)
        self.builder = FlatBatchBuilder(BLOCK, CPU, torch.float32, self.k, self.v, self.slab)
        self.warm_up: dict[str, Any] = {}  # what compile_decode left behind (the fixture fills it)

    def decode_step(self, positions: list[int]) -> llama.StepInputs:
        """A decode step of one row per position (row i owns blocks [40 i, 40 i + 40): 160 positions)."""
        scheduled: Any = [
            SimpleNamespace(
                num_tokens=1,
                start=p,
                samples=True,
                admitted=False,
                seq=SimpleNamespace(
                    request_id=f"r{i}",
                    block_table=list(range(40 * i, 40 * i + 40)),
                    token_ids=[(7 * i + j) % 96 for j in range(p + 1)],
                    prompt_logprobs=None,
                ),
            )
            for i, p in enumerate(positions)
        ]
        with torch.inference_mode():  # as ModelRunner.execute builds it (the slab's tensors too)
            step, _, _ = self.builder.build(scheduled)
        return step

    def run(self, step: llama.StepInputs, compiled: bool) -> torch.Tensor:
        graph = self.forward.decode_graph
        if not compiled:
            self.forward.decode_graph = None
        try:
            with torch.inference_mode():
                return self.forward.hidden_states(step, self.k, self.v)
        finally:
            self.forward.decode_graph = graph


@pytest.fixture(scope="module")
def replica() -> Replica:
    r = Replica()
    before = [c[:, : r.pad_slot].clone() for c in (*r.k, *r.v)]
    # fp32 steps attend over the span alone (strided slab rows): that layout's graph.
    graph = compiled_decode.compile_decode(
        r.forward, r.slab, r.k, r.v, r.pad_slot, MAX_ROWS, whole_length=r.builder.whole_slab_rows
    )
    r.forward.decode_graph = graph
    r.warm_up = {
        "buckets": set(graph.buckets),
        "real_slots_untouched": all(
            torch.equal(c[:, : r.pad_slot], b) for c, b in zip((*r.k, *r.v), before, strict=True)
        ),
        "slab_rows_held": r.slab.rows,
    }
    return r


class Counted:
    """Counts the calls into a compiled graph."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.inner(*args)


@pytest.mark.parametrize(
    "positions",
    [
        [5, 9, 30],  # 3 rows, slab length 32 (span 31: the whole length)
        [3, 40, 2, 17, 60],  # 5 rows, slab length 64
        [100, 7],  # 2 rows, slab length 128, a span (101) shorter than it
        [37],  # 1 row: run as two, the second a pad row
    ],
)
def test_the_graph_gives_the_eager_hidden_states_and_kv_at_untraced_shapes(
    replica: Replica, positions: list[int]
) -> None:
    from torch._dynamo.utils import counters

    graph = replica.forward.decode_graph
    assert graph is not None
    graph.buckets = {1, 2, 4, 8}  # whatever the warm-up's timing said, this test takes the graph
    graphs_at_start = counters["stats"]["unique_graphs"]

    eager_step = replica.decode_step(positions)
    before = (copy.deepcopy(replica.k), copy.deepcopy(replica.v))
    eager = replica.run(eager_step, compiled=False)
    eager_kv = (copy.deepcopy(replica.k), copy.deepcopy(replica.v))
    eager_slab = (copy.deepcopy(replica.slab.k), copy.deepcopy(replica.slab.v))

    # The same step again, from the same cache, through the graph.
    replica.k[:], replica.v[:] = before
    replica.slab.release_all(free_memory=True)
    step = replica.decode_step(positions)
    counted = graph.graph = Counted(graph.graph)
    graph.stance = "fail_on_recompile"  # the graph's guards must hold: no silent eager fallback
    try:
        got = replica.run(step, compiled=True)
    finally:
        graph.graph = counted.inner
        graph.stance = "eager_on_recompile"
    assert counted.calls == 1
    assert counters["stats"]["unique_graphs"] == graphs_at_start  # nothing compiled on a live step
    assert got.shape == eager.shape and got.shape[0] == len(positions)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    # Every real slot as the eager step left it (a pad row may write only the spare slot).
    pad = replica.pad_slot
    for got_cache, eager_cache in zip((*replica.k, *replica.v), (*eager_kv[0], *eager_kv[1]), strict=True):
        torch.testing.assert_close(got_cache[:, :pad], eager_cache[:, :pad], rtol=1e-5, atol=1e-5)
    # Each row's positions up to this step's token; past them a row holds nothing it reads unmasked.
    for got_slab, eager_rows in zip(
        (*replica.slab.k, *replica.slab.v), (*eager_slab[0], *eager_slab[1]), strict=True
    ):
        for row, position in enumerate(positions):
            torch.testing.assert_close(
                got_slab[row, :, : position + 1], eager_rows[row, :, : position + 1], rtol=1e-5, atol=1e-5
            )


def test_steps_the_graph_does_not_cover_run_eagerly(replica: Replica) -> None:
    graph = replica.forward.decode_graph
    assert graph is not None
    graph.buckets = {2, 4, 8}
    assert graph.usable(replica.decode_step([5, 9]))
    assert not graph.usable(replica.decode_step([5]))  # one row: the warm-up did not pick bucket 1
    graph.buckets = {1, 2, 4, 8}
    assert graph.usable(replica.decode_step([5]))  # ...now it did: padded to two rows
    # A span that is the slab's whole length (64) is the other layout's graph: eager here.
    replica.slab.release_all(free_memory=True)  # a fresh slab: 64 positions for these rows
    assert not graph.usable(replica.decode_step([63, 9]))
    graph.buckets = {4, 8}
    assert not graph.usable(replica.decode_step([5, 9]))  # warm-up found eager faster at 2 rows


def test_warm_up_writes_only_the_padding_slot_and_frees_its_slab(replica: Replica) -> None:
    # Calibrated buckets are powers of two up to the slab's row cap.
    assert replica.warm_up["buckets"] <= {1, 2, 4, 8}
    # The warm-up's K/V went to the spare padding slot only: no real slot was written...
    assert replica.warm_up["real_slots_untouched"]
    # ...and its slab was released: the replica starts holding no slab memory.
    assert replica.warm_up["slab_rows_held"] == 0
