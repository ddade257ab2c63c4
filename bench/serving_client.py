"""The serving benchmark's client: a seeded Poisson workload and an OpenAI-SDK load generator.

Every server under test gets the same requests at the same offsets from its
start (Poisson arrivals at ``rate`` per second, or all at once), each streamed
with the official ``openai`` async client, as an application would call it.
Per request: time to the first content (TTFT), the gaps between content
events (ITL), the whole latency, and the completion tokens. Tokens come from
the server's ``usage`` when it sends one (``stream_options.include_usage``),
else from the model's own tokenizer over the text received, so a server that
sends no usage is not credited with more or fewer tokens than it wrote.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import openai

from bench.timings import percentile

# Questions that want a long answer, so most generations run to max_tokens.
QUESTIONS = (
    "Explain how a hash map handles collisions, with an example.",
    "Describe the water cycle step by step.",
    "Write a short story about a lighthouse keeper and a storm.",
    "What should a new team lead do in the first month? Give advice.",
    "Explain the difference between TCP and UDP in detail.",
    "Describe how to bake bread at home, from flour to loaf.",
    "Write a letter to a friend about a trip to the mountains.",
    "Explain why the sky is blue and sunsets are red.",
    "List the steps to plan a small wedding and explain each.",
    "Describe how vaccines train the immune system.",
    "Explain recursion to a beginner with two examples.",
    "Write a product description for a waterproof hiking backpack.",
)
# Context sentences drawn per request (distinct per request: no server gets a shared-prefix gift).
CONTEXT = (
    "The report was filed on a Tuesday after the quarterly review.",
    "Several teams noted that the old process took too many manual steps.",
    "Customers asked for clearer instructions and faster replies.",
    "The warehouse moved to a new building near the river last spring.",
    "A pilot program ran for six weeks with forty volunteers.",
    "Costs rose slightly while satisfaction scores improved.",
    "The committee will meet again once the survey results are in.",
    "Most feedback mentioned the mobile app and the help pages.",
)
CONTEXT_SENTENCES = (0, 2, 6, 16)  # prompt lengths from ~40 to ~300 tokens with the chat template
OUTPUT_TOKENS = (32, 64, 128)


@dataclass(frozen=True)
class ServingRequest:
    """One chat request and when to send it (seconds after the run starts)."""

    at_s: float
    prompt: str
    max_tokens: int


def workload(num_requests: int, rate: float, seed: int) -> list[ServingRequest]:
    """Mixed prompt and output lengths; Poisson arrivals at ``rate``/s (``inf``: all at once)."""
    rng = random.Random(seed)
    requests: list[ServingRequest] = []
    at = 0.0
    for i in range(num_requests):
        context = " ".join(rng.choice(CONTEXT) for _ in range(rng.choice(CONTEXT_SENTENCES)))
        question = QUESTIONS[i % len(QUESTIONS)]
        prompt = f"{context}\n\n{question}".strip() if context else question
        # The label makes every prompt distinct within a workload and, with the seed in it,
        # from every other seed's (the rounds of bench/serving.py send seed, seed + 1, ... to
        # servers that keep their prefix caches). Seed 0 keeps the label its recorded runs had.
        label = f"{i}" if seed == 0 else f"{seed}.{i}"
        requests.append(ServingRequest(at, f"[{label}] {prompt}", rng.choice(OUTPUT_TOKENS)))
        if rate != float("inf"):
            at += rng.expovariate(rate)
    return requests


@dataclass
class Outcome:
    """What one streamed request measured."""

    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    # The prompt as the server counted it (0 when it sent no usage).
    prompt_tokens: int = 0
    tokens_from_usage: bool = False
    finished_at_s: float = 0.0
    error: str = ""


async def stream_one(
    client: openai.AsyncOpenAI,
    model: str,
    request: ServingRequest,
    count_tokens: Callable[[str], int],
    t0: float,
) -> Outcome:
    started = time.perf_counter()
    first: float | None = None
    last = started
    gaps: list[float] = []
    text: list[str] = []
    usage_tokens: int | None = None
    prompt_tokens = 0
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": request.prompt}],
            max_tokens=request.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
                prompt_tokens = chunk.usage.prompt_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    text.append(choice.delta.content)
    except openai.OpenAIError as exc:
        return Outcome(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
    end = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else count_tokens("".join(text))
    return Outcome(
        ok=True,
        ttft_s=(first or end) - started,
        latency_s=end - started,
        itl_s=gaps,
        completion_tokens=tokens,
        prompt_tokens=prompt_tokens,
        tokens_from_usage=usage_tokens is not None,
        finished_at_s=end - t0,
    )


async def run_load(
    base_url: str,
    model: str,
    requests: Sequence[ServingRequest],
    count_tokens: Callable[[str], int],
    max_concurrency: int | None = None,
    timeout_s: float = 900.0,
) -> tuple[list[Outcome], float]:
    """Send every request at its time; returns the outcomes and the run's wall seconds."""
    # One connection per in-flight request, as many as the load needs (the SDK's default caps at 1000).
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", timeout=timeout_s, max_retries=0)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def scheduled(request: ServingRequest) -> Outcome:
        await asyncio.sleep(max(0.0, request.at_s - (time.perf_counter() - t0)))
        if gate is None:
            return await stream_one(client, model, request, count_tokens, t0)
        async with gate:
            return await stream_one(client, model, request, count_tokens, t0)

    try:
        outcomes = list(await asyncio.gather(*(scheduled(r) for r in requests)))
    finally:
        await client.close()
    return outcomes, time.perf_counter() - t0


def arrival_bound(requests: Sequence[ServingRequest], completion_tokens: int) -> float | None:
    """The output tokens/s no server can pass on this workload: its tokens by the last arrival.

    Under Poisson arrivals a server that keeps up is paced by its clients, not by its speed: it
    cannot finish before the last request is sent. Beside a server's tokens/s this says how much
    of the gap to a peer the arrivals leave open (at 48 requests at 4/s, seed 0: the last is
    sent at 9.97 s). None when all requests come at once (no bound from arrivals).
    """
    last = max((r.at_s for r in requests), default=0.0)
    return completion_tokens / last if last > 0 else None


def summarize(outcomes: Sequence[Outcome], wall_s: float) -> dict[str, float | int | str]:
    """Percentiles in ms; output tokens/s over the whole run (first send to last token)."""
    done = [o for o in outcomes if o.ok]
    ttft = [o.ttft_s * 1000 for o in done]
    latency = [o.latency_s * 1000 for o in done]
    itl = [g * 1000 for o in done for g in o.itl_s]
    tokens = sum(o.completion_tokens for o in done)
    prompt = sum(o.prompt_tokens for o in done)
    span = max((o.finished_at_s for o in done), default=wall_s)
    row: dict[str, float | int | str] = {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(done),
        "completion_tokens": tokens,
        "prompt_tokens": prompt,
        "tokens_from_usage": sum(o.tokens_from_usage for o in done),
        "output_tokens_per_s": round(tokens / span, 2) if span > 0 else 0.0,
        # Prompt and output tokens together: every one costs the model's weights once (a
        # prefill-heavy workload is bound by these, whatever the server).
        "processed_tokens_per_s": round((prompt + tokens) / span, 2) if span > 0 else 0.0,
        "requests_per_s": round(len(done) / span, 3) if span > 0 else 0.0,
    }
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl), ("latency_ms", latency)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}"] = round(percentile(values, q), 1) if values else 0.0
    errors = sorted({o.error for o in outcomes if not o.ok})
    if errors:
        row["errors"] = "; ".join(errors[:3])
    return row
