"""The benchmark workloads: which prompts arrive when, and how many tokens each asks for."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol

UNIFORM_PROMPT = "Write a short story about a robot named R{i} who learns to paint."

# Ordinary English words for the mixed workload's prompts: real text tokenizes the way
# user prompts do (a few characters per token), unlike random token ids.
WORD_LIST = (
    "the a robot paints river mountain city light colour quiet morning evening storm garden "
    "learns remembers brush canvas window market friend old young engineer artist machine "
    "slowly quickly because although every never always story chapter music bridge harbour "
    "winter summer autumn spring train station letter museum lantern forest shadow signal "
    "question answer reason careful bright dark warm cold gentle sudden distant near"
)


class ChatTokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the workloads use."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its prompt, its token budget and when it arrives."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    # Seconds after the run starts; 0.0 for every request of `uniform`.
    arrival_s: float


@dataclass(frozen=True)
class Workload:
    """A named, reproducible list of requests sorted by arrival."""

    name: str
    requests: list[BenchRequest]

    @property
    def total_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def all_at_once(self) -> bool:
        return all(r.arrival_s == 0.0 for r in self.requests)


def chat_prompt_ids(tokenizer: ChatTokenizer, text: str) -> list[int]:
    """Token ids of the chat template over one user message, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # transformers 5 may hand back a BatchEncoding-like mapping even with return_dict=False.
    if hasattr(ids, "get") and not isinstance(ids, list):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def uniform(tokenizer: ChatTokenizer, num_requests: int = 64, max_tokens: int = 64) -> Workload:
    """All requests at once; prompt i is the chat template over the R{i} story request."""
    requests = [
        BenchRequest(
            request_id=f"u{i}",
            prompt_token_ids=chat_prompt_ids(tokenizer, UNIFORM_PROMPT.format(i=i)),
            max_tokens=max_tokens,
            arrival_s=0.0,
        )
        for i in range(num_requests)
    ]
    return Workload("uniform", requests)


def mixed(
    tokenizer: ChatTokenizer,
    num_requests: int = 128,
    *,
    arrival_rate: float = 2.0,
    prompt_tokens: tuple[int, int] = (20, 600),
    max_tokens: tuple[int, int] = (16, 256),
    seed: int = 0,
) -> Workload:
    """Poisson arrivals (rate per second) with prompt lengths and token budgets drawn uniformly.

    Prompts are exact-length slices of tokenized plain text (no chat template: its system
    preamble alone is longer than the shortest prompts this workload asks for).
    """
    if arrival_rate <= 0:
        raise ValueError("arrival_rate must be > 0 requests per second")
    rng = random.Random(seed)
    words = WORD_LIST.split()
    longest = prompt_tokens[1]
    text = " ".join(rng.choice(words) for _ in range(longest * 3))
    corpus = tokenizer.encode(text, add_special_tokens=False)
    if len(corpus) < longest * 2:
        raise ValueError("tokenizer produced too few tokens for the mixed workload's prompts")
    requests: list[BenchRequest] = []
    clock = 0.0
    for i in range(num_requests):
        clock += rng.expovariate(arrival_rate)
        length = rng.randint(*prompt_tokens)
        start = rng.randrange(0, len(corpus) - length)
        requests.append(
            BenchRequest(
                request_id=f"m{i}",
                prompt_token_ids=corpus[start : start + length],
                max_tokens=rng.randint(*max_tokens),
                arrival_s=round(clock, 6),
            )
        )
    return Workload("mixed", requests)
