"""Single-text embeds from concurrent requests, coalesced into one model call.

Every chat turn with the semantic cache on embeds its prompt (the lookup), and each
request runs on its own executor thread. One text per model call leaves most of the
CPU's work to per-call overhead: all-MiniLM-L6-v2 took 8.7 ms a text one at a time
and 4.9 ms a text in batches of 6 on the 2-vCPU VM (docs/benchmarks.md, "concurrent
query embeds coalesced"). So single texts go through one worker thread, which takes every text
waiting when it comes free and encodes them in one call, the way continuous batching
forms a decode step: nothing is held back to wait for company, so a lone request pays
no added latency, and under load the batch grows by itself. One thread also means one
OpenMP pool for these calls instead of one per executor thread (docs/inference.md,
"One engine thread").
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np
import numpy.typing as npt

log = logging.getLogger("llmmesh.retriever.embed")

Vectors = npt.NDArray[np.float32]
Encode = Callable[[Sequence[str]], Vectors]

#: The most texts one coalesced call takes. Per-text cost was flat from 6 to 16 (4.6–5.7 ms)
#: and a batch of 16 is ≈ 80 ms of CPU, which bounds what one request can wait behind.
MAX_BATCH = 16


class EmbedCoalescer:
    """Runs ``encode`` on one worker thread over whatever single texts are waiting."""

    def __init__(
        self,
        encode: Encode,
        max_batch: int = MAX_BATCH,
        name: str = "embed",
        observe: Callable[[int], None] | None = None,
    ) -> None:
        """``observe`` is told each model call's number of texts (the service's Prometheus histogram)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._encode = encode
        self._observe = observe
        self.max_batch = max_batch
        self._waiting: queue.SimpleQueue[tuple[str, Future[Vectors]] | None] = queue.SimpleQueue()
        #: Model calls made and texts they encoded since start: how much coalescing happened.
        self.calls = 0
        self.texts = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def embed(self, text: str) -> Vectors:
        """``text``'s vector, shape ``(1, dimension)``; blocks the calling thread until it is made."""
        if self._closed:
            raise RuntimeError("the embedder is closed")
        done: Future[Vectors] = Future()
        self._waiting.put((text, done))
        return done.result()

    def close(self) -> None:
        """Ends the worker once the texts already waiting are done; later ``embed`` calls raise."""
        self._closed = True
        self._waiting.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            first = self._waiting.get()
            if first is None:
                return
            batch = [first]
            closing = False
            while len(batch) < self.max_batch:
                try:
                    item = self._waiting.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    break
                batch.append(item)
            try:
                self._answer(batch)
            # The worker must outlive any one batch: else every later embed hangs.
            except BaseException as exc:
                log.exception("embed worker: a coalesced call failed unexpectedly")
                for _, done in batch:
                    if not done.done():
                        done.set_exception(exc)
            if closing:
                return

    def _answer(self, batch: list[tuple[str, Future[Vectors]]]) -> None:
        # The same text asked twice at once (a popular question) is encoded once.
        texts = list(dict.fromkeys(text for text, _ in batch))
        self.calls += 1
        self.texts += len(texts)
        if self._observe is not None:
            try:
                self._observe(len(texts))
            except Exception:  # a metrics hook never costs a request its answer
                log.exception("embed worker: observing a call's size failed")
        try:
            vectors = self._encode(texts)
        except Exception as exc:  # every waiter must hear back, never hang
            if len(texts) == 1:
                for _, done in batch:
                    done.set_exception(exc)
                return
            # One text the model rejects must not fail the requests that happened to share its
            # call: each is encoded alone, so only its own request sees the error.
            log.warning("coalesced embed of %d texts failed (%s); encoding each alone", len(texts), exc)
            for text, done in batch:
                try:
                    done.set_result(self._encode([text]))
                except Exception as alone:
                    done.set_exception(alone)
            return
        row = {text: i for i, text in enumerate(texts)}
        for text, done in batch:
            i = row[text]
            done.set_result(vectors[i : i + 1].copy())  # not a view pinning the whole batch
