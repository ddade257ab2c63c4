"""The synthetic answer: token ids from a hash of the prompt and the index, paced like an engine's steps.

Token ``i`` of an answer depends only on the prompt, the seed and ``i``, so a
generation resumed from any index on any replica continues exactly as the
original would (what router failover relies on), and a test can compute the
whole expected answer (``synthetic_token``).
"""

from __future__ import annotations

import asyncio
import hashlib

from services.gen.llmmesh.v1 import inference_pb2

VOCAB_SIZE = 49152


def prompt_key(start: inference_pb2.GenerateStart) -> bytes:
    """What the token stream depends on: the prompt and the sampling seed."""
    text = start.prompt or "\n".join(f"{m.role}:{m.content}" for m in start.messages)
    seed = start.sampling.seed if start.sampling.HasField("seed") else 0
    return hashlib.blake2b(f"{seed}|{text}".encode(), digest_size=16).digest()


def synthetic_token(key: bytes, index: int) -> int:
    """Token ``index`` of the answer to ``key``: the same on every replica, for any resume point."""
    digest = hashlib.blake2b(index.to_bytes(4, "big"), key=key, digest_size=4).digest()
    return int.from_bytes(digest, "big") % VOCAB_SIZE


def synthetic_text(token_id: int) -> str:
    return f" t{token_id}"


def prompt_tokens(start: inference_pb2.GenerateStart) -> int:
    # A rough count (4 characters a token) so usage looks plausible.
    chars = len(start.prompt) + sum(len(m.content) + 4 for m in start.messages)
    return max(1, chars // 4)


class StepClock:
    """One step boundary shared by every stream of a replica, like an engine's decode step.

    A continuous-batching engine produces one token for each running sequence
    per step, so its streams get their tokens at the same moment; this clock
    wakes all waiting streams at once on a grid of ``step_s``. The timer runs
    only while some stream waits.
    """

    def __init__(self, step_s: float) -> None:
        if step_s <= 0:
            raise ValueError("step_s must be > 0")
        self.step_s = step_s
        #: The number of the step that fired last (steps are numbered from the loop clock's zero).
        self.step = 0
        self._tick = asyncio.Event()
        self._armed = False

    async def next_step(self) -> None:
        """Return at the next step boundary."""
        if not self._armed:
            loop = asyncio.get_running_loop()
            upcoming = int(loop.time() / self.step_s) + 1
            loop.call_at(upcoming * self.step_s, self._fire, upcoming)
            self._armed = True
        await self._tick.wait()

    def _fire(self, step: int) -> None:
        self._armed = False
        self.step = step
        self._tick.set()  # wakes every stream waiting now ...
        self._tick.clear()  # ... and none that starts waiting after
