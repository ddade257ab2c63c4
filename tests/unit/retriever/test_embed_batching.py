"""Concurrent single-text embeds share model calls, each caller gets its own text's vector, and
one text the model rejects fails only its own request."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from services.retriever.embed_batching import EmbedCoalescer, Vectors
from services.retriever.embedder import Embedder


class GatedEncode:
    """An encode whose first call waits until released, so callers can pile up behind it.

    Each text's vector is derived from its characters, so a vector handed to the wrong
    caller shows. A text containing ``poison`` makes the whole call raise, as a model
    rejecting one input would.
    """

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, texts: Sequence[str]) -> Vectors:
        self.calls.append(list(texts))
        if len(self.calls) == 1:
            self.entered.set()
            assert self.release.wait(10)
        if any("poison" in t for t in texts):
            raise ValueError("the model rejected an input")
        return np.stack([vector_of(t) for t in texts])


def vector_of(text: str) -> Vectors:
    return np.array([len(text), sum(map(ord, text)), ord(text[0]), ord(text[-1])], dtype=np.float32)


def pile_up(coalescer: EmbedCoalescer, encode: GatedEncode, texts: list[str]) -> list[Future[Vectors]]:
    """One call in flight, then ``texts`` submitted from their own threads while it runs."""
    pool = ThreadPoolExecutor(len(texts) + 1)
    first = pool.submit(coalescer.embed, "the first question")
    assert encode.entered.wait(10)
    waiting = [pool.submit(coalescer.embed, t) for t in texts]
    # Each submitted thread is blocked in embed() once the queue holds its text.
    deadline = time.monotonic() + 10
    while coalescer._waiting.qsize() < len(texts) and time.monotonic() < deadline:
        time.sleep(0.01)
    encode.release.set()
    np.testing.assert_array_equal(first.result(10), vector_of("the first question")[None])
    pool.shutdown(wait=False)
    return waiting


def assert_each_got_its_own(texts: list[str], results: list[Future[Vectors]]) -> None:
    for text, result in zip(texts, results, strict=True):
        np.testing.assert_array_equal(result.result(10), vector_of(text)[None])


def test_texts_waiting_behind_a_call_go_together_in_the_next_one_each_with_its_own_vector() -> None:
    encode = GatedEncode()
    coalescer = EmbedCoalescer(encode, max_batch=16)
    texts = [f"question number {i} about pumps" for i in range(6)]
    results = pile_up(coalescer, encode, texts)
    assert_each_got_its_own(texts, results)
    # Threads enqueue in any order; what matters is one call for all six.
    assert len(encode.calls) == 2 and sorted(encode.calls[1]) == sorted(texts)
    coalescer.close()


def test_a_lone_text_is_encoded_at_once_and_a_batch_never_exceeds_its_cap() -> None:
    encode = GatedEncode()
    encode.release.set()
    coalescer = EmbedCoalescer(encode, max_batch=4)
    np.testing.assert_array_equal(coalescer.embed("alone"), vector_of("alone")[None])
    assert encode.calls == [["alone"]]

    encode2 = GatedEncode()
    capped = EmbedCoalescer(encode2, max_batch=4)
    texts = [f"text {i}" for i in range(10)]
    results = pile_up(capped, encode2, texts)
    assert_each_got_its_own(texts, results)
    assert all(len(call) <= 4 for call in encode2.calls)
    assert sum(len(call) for call in encode2.calls) == 11


def test_each_model_call_reports_how_many_texts_it_took() -> None:
    encode = GatedEncode()
    sizes: list[int] = []
    coalescer = EmbedCoalescer(encode, observe=sizes.append)
    results = pile_up(coalescer, encode, ["a?", "b?", "c?"])
    for r in results:
        r.result(10)
    assert sizes == [1, 3]
    assert (coalescer.calls, coalescer.texts) == (2, 4)


def test_a_failing_metrics_hook_costs_no_request_its_answer() -> None:
    encode = GatedEncode()
    encode.release.set()

    def broken(_: int) -> None:
        raise RuntimeError("metrics registry gone")

    coalescer = EmbedCoalescer(encode, observe=broken)
    for text in ("first", "second"):
        np.testing.assert_array_equal(coalescer.embed(text), vector_of(text)[None])


def test_the_same_text_asked_at_once_is_encoded_once() -> None:
    encode = GatedEncode()
    coalescer = EmbedCoalescer(encode)
    results = pile_up(coalescer, encode, ["popular question?"] * 5)
    assert all(np.array_equal(r.result(10), vector_of("popular question?")[None]) for r in results)
    assert encode.calls[1:] == [["popular question?"]]


def test_a_text_the_model_rejects_fails_only_its_own_request() -> None:
    encode = GatedEncode()
    coalescer = EmbedCoalescer(encode)
    texts = ["good one", "poison pill", "good two"]
    results = pile_up(coalescer, encode, texts)
    np.testing.assert_array_equal(results[0].result(10), vector_of("good one")[None])
    np.testing.assert_array_equal(results[2].result(10), vector_of("good two")[None])
    with pytest.raises(ValueError, match="rejected"):
        results[1].result(10)
    # Then the service goes on: a later text is answered.
    np.testing.assert_array_equal(coalescer.embed("after"), vector_of("after")[None])


def test_a_closed_coalescer_refuses_new_texts_instead_of_leaving_them_waiting() -> None:
    encode = GatedEncode()
    encode.release.set()
    coalescer = EmbedCoalescer(encode)
    coalescer.close()
    with pytest.raises(RuntimeError, match="closed"):
        coalescer.embed("too late")


def test_the_real_model_gives_a_query_the_same_vector_coalesced_as_alone() -> None:
    """Padding to the batch's longest text must not move a query's vector (the semantic cache
    compares them at 0.92 and the dense search ranks by them)."""
    embedder = Embedder()
    texts = [
        "How many moons does Mars have?",
        "Explain the difference between a lease and a licence in property law, with examples.",
        "pump QZ-7781 pressure fault",
        "日本の首都はどこですか",
    ]
    alone = np.concatenate([embedder._encode([t]) for t in texts])
    together = embedder._encode(texts)  # what one coalesced call does
    np.testing.assert_allclose(together, alone, atol=2e-5)
    assert (np.sum(together * alone, axis=1) > 0.99999).all()
