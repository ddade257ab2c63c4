"""The prefix block hashes of an incoming request, as the replica's block manager will compute them.

The router loads the model's tokenizer and chat template (``--tokenizer``: a model directory or
a ``.gguf`` file; never the weights), renders a ``GenerateStart`` to exactly the token ids the
replica prefills (the shared rendering, ``services/common/prompts.py``, plus any resumed
tokens) and hashes its full blocks with the mesh-wide chain hash
(``services/common/kv_blocks.py``). Placement scores each replica's cached prefix from them.
The rendered chat is tokenized segment by segment with a cache (``segment_encoder.py``): the
same ids, but a system prompt or context shared by many requests is tokenized once.

Loading takes a few seconds (importing transformers; ~45 s on a busy 2-core machine), so it
runs off the event loop after the router starts; until it is done, and for a request the
replica would refuse anyway, there are no hashes and placement treats the prompt as uncached
(``llmmesh_router_prefix_tokenizer_loaded`` says when it is done).

A turn's hashes are computed on one worker thread of their own (``prefix``): a prompt whose
segments are not cached yet takes ~32 ms to tokenize (2,000 tokens), which on the event
loop would stall every other stream for that long. One thread, because a Hugging Face fast
tokenizer is not safe to call from several at once, and tokenizing is serial CPU work anyway.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.errors import InvalidArgument
from services.common.kv_blocks import block_hashes, salt_seed
from services.common.prompts import Message, prompt_token_ids
from services.gen.llmmesh.v1 import inference_pb2
from services.router import metrics
from services.router.placement.request import NO_PREFIX, PromptPrefix
from services.router.placement.segment_encoder import SegmentEncoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("llmmesh.router.prompt_hashes")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer and chat template of a model directory or ``.gguf`` file (no weights)."""
    from transformers import AutoTokenizer

    p = Path(path)
    if p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(str(p))


def common_block_size(sizes: Iterable[int]) -> int:
    """The block size most replicas report (0 when none is known yet)."""
    counts = Counter(s for s in sizes if s > 0)
    return counts.most_common(1)[0][0] if counts else 0


#: A prompt longer than this is placed without hashes: 128 characters a token of an 8,192-token
#: context (a replica refuses more unread, inference/servicer.py), and tokenizing 1 MB takes
#: the worker seconds.
MAX_HASHED_CHARS = 8192 * 128
#: How long a turn waits for its hashes before it is placed without them (a prompt of a few
#: thousand tokens takes ~1-3 ms, its shared segments remembered, ~30 ms unseen; docs/benchmarks.md).
HASH_WAIT_S = 0.25


def _prompt_chars(start: inference_pb2.GenerateStart) -> int:
    return len(start.prompt) + sum(len(m.content) for m in start.messages)


class PromptHasher:
    """Token ids and prefix block hashes of a ``GenerateStart``."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None = None,
        block_size: Callable[[str], int] = lambda model: 0,
    ) -> None:
        self.tokenizer = tokenizer
        self._encoder = SegmentEncoder(tokenizer) if tokenizer is not None else None
        #: The block size a model's replicas use ("" = any model), when the caller names none
        #: (the pool's, see runtime.py).
        self.block_size = block_size
        #: Where turns' prompts are tokenized and hashed, off the event loop (started on first use).
        self._worker: ThreadPoolExecutor | None = None

    async def load(self, path: str) -> None:
        """Load the tokenizer off the event loop; a failure leaves prefix placement off, said once."""
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, path)
        except Exception as exc:  # a missing or unreadable model: the router serves on without hashes
            log.warning("--tokenizer %s could not be loaded (%s): no prefix hashes", path, exc)
            return
        self._encoder = SegmentEncoder(tokenizer)
        self.tokenizer = tokenizer
        metrics.PREFIX_TOKENIZER_LOADED.set(1)
        log.info("prefix hashes from the tokenizer of %s", path)

    @property
    def ready(self) -> bool:
        """The tokenizer is loaded: prompts get their hashes."""
        return self.tokenizer is not None

    def token_ids(self, start: inference_pb2.GenerateStart) -> list[int] | None:
        """The ids the replica will prefill for ``start``; None without a tokenizer or for a
        request the replica will refuse (its error reaches the client from there)."""
        if self.tokenizer is None or self._encoder is None:
            return None
        try:
            ids = prompt_token_ids(
                self.tokenizer,
                [Message(m.role, m.content) for m in start.messages],
                start.prompt,
                self._encoder.encode,  # the same ids, a shared system prompt tokenized once
                token_ids=start.prompt_token_ids,
            )
        except InvalidArgument:
            return None
        return [*ids, *start.resume_token_ids]

    def hashes(
        self, start: inference_pb2.GenerateStart, block_size: int = 0, model: str = ""
    ) -> tuple[int, list[int]]:
        """(block size, the chain hash of every full block of the prompt). No hashes when the
        block size or the ids are not known."""
        size, hashes, _ = self._chain(start, block_size, model)
        return size, hashes

    async def prefix(self, start: inference_pb2.GenerateStart, model: str) -> PromptPrefix:
        """The turn's hook (``TurnServices.prompt_prefix``): the placement request's prefix,
        computed on the hasher's worker thread so a long unseen prompt does not stall the loop.

        Bounded: a prompt over ``MAX_HASHED_CHARS`` is not hashed, and a turn waits at most
        ``HASH_WAIT_S`` for its hashes, then is placed without them (they are still made, and
        the segments they tokenized are remembered for the next turns). The one worker made
        every turn wait behind a few 4 MB prompts: a short one took 11-12 s.
        """
        if self.tokenizer is None:
            return NO_PREFIX
        # The block size reads the pool: on the loop, where the pool is changed.
        size = self.block_size(model)
        if size <= 0 or _prompt_chars(start) > MAX_HASHED_CHARS:
            return NO_PREFIX
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-hashes")
        hashing = asyncio.get_running_loop().run_in_executor(self._worker, self.prefix_now, start, size)
        try:
            return await asyncio.wait_for(asyncio.shield(hashing), HASH_WAIT_S)
        except TimeoutError:
            metrics.PREFIX_HASH_TIMEOUTS.inc()
            return NO_PREFIX

    def prefix_now(self, start: inference_pb2.GenerateStart, block_size: int) -> PromptPrefix:
        """The placement request's prefix for ``start`` with ``block_size``, on the calling thread."""
        size, hashes, prompt_tokens = self._chain(start, block_size, "")
        return PromptPrefix(hashes, size, prompt_tokens) if hashes else NO_PREFIX

    def close(self) -> None:
        """Stop the worker thread (the router's shutdown)."""
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None

    def _chain(
        self, start: inference_pb2.GenerateStart, block_size: int, model: str
    ) -> tuple[int, list[int], int]:
        size = block_size or self.block_size(model)
        if size <= 0:
            return 0, [], 0
        ids = self.token_ids(start)
        if not ids:
            return size, [], 0
        try:
            return size, block_hashes(ids, size, salt_seed(start.cache_salt)), len(ids)
        except ValueError:  # a resumed token id out of range: the replica refuses it
            return size, [], 0
