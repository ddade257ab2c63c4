"""The router's prompt hashes with the real SmolLM2 tokenizer (no weights, no servers): the same ids
the replica prefills, the same block chain its block manager registers."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from services.common.errors import InvalidArgument
from services.common.kv_blocks import block_hashes
from services.common.prompts import Message, prompt_token_ids
from services.gen.llmmesh.v1 import common_pb2, inference_pb2
from services.inference.block_manager import BlockManager
from services.inference.model_loading import load_tokenizer as replica_tokenizer
from services.inference.sampling import SamplingParams
from services.inference.sequence import Sequence
from services.router.placement.prompt_hashes import PromptHasher, load_tokenizer
from services.router.placement.segment_encoder import SegmentEncoder

SYSTEM = "You answer questions about orders, refunds and shipping for an online bookshop. " * 10


@pytest.fixture(scope="module")
def hasher(model_path: Path) -> PromptHasher:
    return PromptHasher(load_tokenizer(str(model_path)))


def chat(*turns: tuple[str, str]) -> inference_pb2.GenerateStart:
    return inference_pb2.GenerateStart(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in turns])


def registered_hashes(token_ids: list[int], block_size: int) -> set[int]:
    """What a replica's block manager registers for a prompt it prefilled."""
    bm = BlockManager(num_blocks=len(token_ids) // block_size + 2, block_size=block_size)
    seq = Sequence(
        request_id="r", token_ids=list(token_ids), num_prompt_tokens=len(token_ids), params=SamplingParams()
    )
    assert bm.allocate(seq, len(token_ids))
    seq.num_computed_tokens = len(token_ids)
    bm.commit(seq)
    bm.events.publish()  # the end of the engine step
    return set(bm.events.snapshot().block_hashes)


@pytest.mark.parametrize(
    "turns",
    [
        (("system", SYSTEM), ("user", "Where is order 1234?"), ("assistant", "Shipped."), ("user", "When?")),
        # A call given back and its result (a tool turn), as the OpenAI front renders them.
        (
            ("system", SYSTEM),
            ("user", "Where is order 1234?"),
            ("assistant", '{"name": "track", "arguments": {"order": 1234}}'),
            ("tool", '{"status": "shipped"}'),
        ),
    ],
)
def test_router_hashes_equal_the_replicas_own_block_hashes_for_the_same_chat(
    hasher: PromptHasher, model_path: Path, turns: tuple[tuple[str, str], ...]
) -> None:
    start = chat(*turns)
    # The replica's side: its own tokenizer load and rendering, then its block manager.
    replica_ids = prompt_token_ids(
        replica_tokenizer(str(model_path)), [Message(m.role, m.content) for m in start.messages], ""
    )
    assert hasher.token_ids(start) == replica_ids
    for block_size in (16, 32):
        size, hashes = hasher.hashes(start, block_size)
        assert size == block_size and len(hashes) == len(replica_ids) // block_size
        assert set(hashes) == registered_hashes(replica_ids, block_size)


def test_resumed_tokens_extend_the_chain_and_a_refused_request_has_none(hasher: PromptHasher) -> None:
    start = chat(("user", "Hi"))
    start.resume_token_ids.extend([42] * 20)
    ids = hasher.token_ids(start)
    assert ids is not None and ids[-20:] == [42] * 20
    assert hasher.hashes(start, 8) == (8, block_hashes(ids, 8))
    # The replica refuses these; the router computes nothing and raises nothing.
    assert hasher.hashes(chat(("wizard", "x")), 16) == (16, [])
    assert hasher.hashes(
        inference_pb2.GenerateStart(messages=chat(("user", "x")).messages, resume_token_ids=[-1]), 1
    ) == (1, [])
    assert PromptHasher(None).hashes(start, 16) == (16, [])  # tokenizer still loading


def test_segment_cached_encoding_gives_the_tokenizers_own_ids(hasher: PromptHasher) -> None:
    tokenizer = hasher.tokenizer
    assert tokenizer is not None
    encoder = SegmentEncoder(tokenizer)
    assert encoder.exact
    rng = random.Random(7)
    pieces = [
        "<|im_start|>",
        "<|im_end|>",
        "\n",
        "  ",
        " ",
        "\t",
        "é",
        "日本",
        "42",
        "don't",
        "x",
        "!!",
        "<|im_",
        "user",
    ]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40)))
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False), repr(text)
    # Twice the same: the second comes from the cache, still the same ids.
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=False)
    assert isinstance(rendered, str)
    assert (
        encoder.encode(rendered)
        == encoder.encode(rendered)
        == tokenizer.encode(rendered, add_special_tokens=False)
    )


async def test_the_turns_prefix_hook_gives_the_hashes_with_the_models_block_size(
    hasher: PromptHasher,
) -> None:
    sizes = {"SmolLM2-135M-Instruct": 16}
    hook = PromptHasher(hasher.tokenizer, block_size=lambda model: sizes.get(model, 0))
    start = chat(("system", SYSTEM), ("user", "Hi"))
    try:
        prefix = await hook.prefix(start, "SmolLM2-135M-Instruct")
        ids = hook.token_ids(start)
        assert ids is not None
        assert prefix.block_size == 16 and list(prefix.hashes) == block_hashes(ids, 16)
        assert prefix.prompt_tokens == len(ids)
        # No replica of it reports a block size.
        assert not (await hook.prefix(start, "another-model")).hashes
    finally:
        hook.close()


async def test_tokenizing_an_unseen_long_prompt_leaves_the_event_loop_free(hasher: PromptHasher) -> None:
    # A 2,000-token prompt never seen takes ~30 ms to tokenize: on the loop, every other stream
    # would wait that long. On the hasher's thread, a ticker on the loop keeps ticking.
    hook = PromptHasher(hasher.tokenizer, block_size=lambda model: 16)
    rng = random.Random(7)
    words = ["order", "refund", "parcel", "invoice", "courier", "delay", "stock", "price"]
    prompts = [
        chat(("system", f"{i} " + " ".join(rng.choice(words) for _ in range(2000))), ("user", "Hi"))
        for i in range(6)
    ]
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = loop.time()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    try:
        started = time.perf_counter()
        prefixes = [await hook.prefix(p, "m") for p in prompts]
        hashing_s = time.perf_counter() - started
    finally:
        done.set()
        await ticking
        hook.close()
    assert all(len(p.hashes) >= 2000 // 16 for p in prefixes)
    # The loop kept running meanwhile: on average at least every 10 ms (the thread still takes
    # the GIL for the template's rendering, at most a 5 ms switch interval at a time). Hashed
    # on the loop it would tick once between prompts, ~30 ms each.
    assert len(gaps) >= hashing_s / 0.010, (len(gaps), hashing_s)


def test_only_the_prefix_policy_tokenizes_prompts(model_path: Path) -> None:
    from services.router.runtime import RouterRuntime, RouterSettings
    from services.router.turns.dependencies import no_prefix

    prefix = RouterRuntime(
        RouterSettings(replicas=["127.0.0.1:1"], policy="prefix", tokenizer=str(model_path))
    )
    assert prefix.services.prompt_prefix == prefix.prompt_hasher.prefix
    assert prefix.pool.indexed_blocks == prefix.prefix_index.block_count  # ListReplicas reads the index
    other = RouterRuntime(RouterSettings(replicas=["127.0.0.1:1"], tokenizer=str(model_path)))
    assert other.services.prompt_prefix is no_prefix


def test_a_chat_template_that_refuses_the_conversation_is_a_bad_request_naming_messages(
    model_path: Path,
) -> None:
    # Another model's template may raise on a role or an order it does not take (Jinja's
    # raise_exception, as Llama 2's and Gemma's do): the client's conversation, not a server fault.
    tokenizer = replica_tokenizer(str(model_path))
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('tool turns are not supported') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    assert prompt_token_ids(tokenizer, [Message("user", "Hi")], "") == tokenizer.encode(
        "Hi", add_special_tokens=False
    )
    with pytest.raises(InvalidArgument) as refused:
        prompt_token_ids(tokenizer, [Message("user", "Hi"), Message("tool", "42")], "")
    assert refused.value.field == "messages" and "tool turns are not supported" in str(refused.value)


async def test_a_long_prompt_on_the_hasher_holds_up_no_other_turn(hasher: PromptHasher) -> None:
    """One worker hashes every turn's prompt: a short prompt behind three 3.9 MB ones waited
    11-12 s. Now a prompt past what any replica takes is not hashed, and a turn waits at most
    HASH_WAIT_S for its hashes."""
    from services.router import metrics
    from services.router.placement.prompt_hashes import HASH_WAIT_S, MAX_HASHED_CHARS

    hook = PromptHasher(hasher.tokenizer, block_size=lambda model: 16)
    rng = random.Random(11)
    words = ["order", "refund", "parcel", "invoice", "courier", "delay", "stock", "price"]
    try:
        too_long = chat(("user", "x" * (MAX_HASHED_CHARS + 1)))
        started = time.perf_counter()
        assert not (await hook.prefix(too_long, "m")).hashes
        assert time.perf_counter() - started < 0.1  # not even read
        # Under the bound, but seconds of tokenizing: the turn behind it does not wait for it.
        long = chat(("user", " ".join(rng.choice(words) for _ in range(120_000))))
        timeouts = metrics.PREFIX_HASH_TIMEOUTS._value.get()
        hashing = asyncio.create_task(hook.prefix(long, "m"))
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        short = await hook.prefix(chat(("user", "Where is my parcel?")), "m")
        waited = time.perf_counter() - started
        assert waited < HASH_WAIT_S + 0.5, waited
        assert not short.hashes  # placed without them, not late
        await hashing
        assert metrics.PREFIX_HASH_TIMEOUTS._value.get() >= timeouts + 1
    finally:
        hook.close()
