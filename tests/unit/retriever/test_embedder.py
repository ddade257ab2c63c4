"""The embedder's memo of recent single texts: one model call per text, batches never kept."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import pytest

from services.retriever import embedder as embedder_module
from services.retriever.embed_batching import EmbedCoalescer
from services.retriever.embedder import Embedder


class CountingModel:
    """Stands in for the SentenceTransformer: a deterministic vector per text, and a call count."""

    def __init__(self) -> None:
        self.texts_encoded: list[str] = []

    def encode(self, texts: Sequence[str], **_: object) -> np.ndarray:
        self.texts_encoded.extend(texts)
        return np.stack([np.arange(1, 5, dtype=np.float32) * (1 + len(t)) for t in texts])


def counting_embedder() -> tuple[Embedder, CountingModel]:
    model = CountingModel()
    embedder = object.__new__(Embedder)
    embedder._model = model  # type: ignore[assignment]
    embedder.dimension = 4
    embedder.batch_size = 32
    embedder._memo = OrderedDict()
    embedder._memo_lock = threading.Lock()
    embedder._coalescer = EmbedCoalescer(embedder._encode)
    return embedder, model


def test_the_same_query_twice_is_encoded_once_and_gets_the_same_vector() -> None:
    embedder, model = counting_embedder()
    first = embedder.embed(["how many moons has Mars?"])
    second = embedder.embed(["how many moons has Mars?"])
    assert model.texts_encoded == ["how many moons has Mars?"]
    np.testing.assert_array_equal(first, second)
    assert first.shape == (1, 4) and abs(float(np.linalg.norm(first[0])) - 1.0) < 1e-6
    with pytest.raises(ValueError):
        first[0, 0] = 5.0  # shared by every caller: read-only


def test_batches_and_long_texts_are_encoded_every_time_and_never_kept() -> None:
    embedder, model = counting_embedder()
    embedder.embed(["chunk one", "chunk two"])
    embedder.embed(["chunk one", "chunk two"])
    long_text = "x" * (embedder_module._MEMO_MAX_CHARS + 1)
    embedder.embed([long_text])
    embedder.embed([long_text])
    assert model.texts_encoded == ["chunk one", "chunk two"] * 2 + [long_text] * 2
    assert not embedder._memo


def test_the_memo_forgets_the_least_recently_used_text_past_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedder_module, "_MEMO_ENTRIES", 2)
    embedder, model = counting_embedder()
    for text in ("a", "b", "a", "c", "a", "b"):
        embedder.embed([text])
    # "b" was the least recently used when "c" came in, so it is encoded again; "a" never is.
    assert model.texts_encoded == ["a", "b", "c", "b"]
