"""The router's OpenAI front over real sockets: the official SDK, LangChain and raw httpx against a
router process with a real replica (SmolLM2 on CPU, fp32). Answers stay short for the CI CPU."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import grpc
import httpx
import jsonschema
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gen.llmmesh.v1 import common_pb2, router_pb2
from tests.support.openai_front import README_BASE, http_base, keys_file, load_tool_texts, readme_block
from tests.support.processes import ServiceProcess
from tests.support.router_mesh import router_stub, running_sequences, user_turn

KEY = "sk-test-tenant-a"
LIMITED_KEY = "sk-test-limited"
REVOKED_KEY = "sk-test-revoked"
HELLO = [{"role": "user", "content": "Name three colours."}]


@dataclass
class Front:
    router: ServiceProcess
    replica: ServiceProcess
    base: str
    model: str

    @property
    def v1(self) -> str:
        return f"{self.base}/v1"

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.v1, api_key=KEY, max_retries=0, **kwargs)  # type: ignore[arg-type]

    def post(
        self, path: str, body: object, key: str | None = KEY, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        sent = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.base}{path}", json=body, headers={**sent, **(headers or {})}, timeout=60)


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[Front]:
    keys = keys_file(
        tmp_path_factory.mktemp("keys") / "keys.yaml",
        {
            KEY: {"tenant": "a"},
            # One request, then a refill so slow that the second is refused.
            LIMITED_KEY: {"tenant": "b", "requests_per_second": 0.001, "burst": 1},
            REVOKED_KEY: {"tenant": "c", "revoked": True},
        },
    )
    replica = ServiceProcess(
        "services.inference",
        ["--model", str(model_path), "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "2"],
    ).start(240)
    router = ServiceProcess(
        "services.router",
        [
            "--replicas",
            replica.address,
            "--health-interval-s",
            "0.3",
            # These tests count the replica's sequences: the router's own probe must not be one.
            "--probe-interval-s",
            "0",
            "--api-keys-file",
            str(keys),
            "--http-port",
            "0",
            "--http-keepalive-s",
            "0.3",
            "--http-max-body-bytes",
            "65536",
            "--metrics-port",
            "0",
        ],
    )
    try:
        router.start()
        base = http_base(router)
        models = httpx.get(f"{base}/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=10).json()
        yield Front(router, replica, base, models["data"][0]["id"])
    finally:
        router.stop()
        replica.stop()


@pytest.fixture(scope="module")
def hf_tokenizer(model_path: Path) -> Any:
    """The model's own tokenizer, for prompts sent as token ids."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture(scope="module")
def reference_logprobs(model_path: Path) -> Callable[[list[int]], torch.Tensor]:
    """transformers' fp32 log-softmaxed logits at every position of ``ids``: [len, vocab]."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)

    def forward(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return forward


def greedy(front: Front, messages: list[dict[str, str]], max_tokens: int = 10) -> str:
    answer = front.client().chat.completions.create(
        model=front.model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,  # type: ignore[arg-type]
    )
    return answer.choices[0].message.content or ""


# -- the official SDK


def test_sdk_chat_answer_carries_id_usage_and_finish_reason(front: Front) -> None:
    answer = front.client().chat.completions.create(
        model=front.model,
        messages=HELLO,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
    )
    assert answer.id.startswith("chatcmpl-") and answer.object == "chat.completion"
    assert answer.model == front.model and answer.system_fingerprint and answer.created > 0
    (choice,) = answer.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 6 and answer.usage.prompt_tokens > 0
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 6


def test_cache_salt_keeps_a_cached_prompt_to_its_own_salt_as_vllms_does(front: Front) -> None:
    """The OpenAI SDK's extra_body cache_salt (vLLM's field): the prompt's cached blocks are
    reused under the same salt and under no other, as usage.prompt_tokens_details reports."""
    system = "You keep the minutes of a closed meeting about the Aster project budget. " * 8
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise."}]

    def cached(salt: str) -> int:
        answer = front.client().chat.completions.create(
            model=front.model, messages=messages, max_tokens=1, temperature=0,  # type: ignore[arg-type]
            extra_body={"cache_salt": salt, "cache": "bypass"},
        )  # fmt: skip
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        return answer.usage.prompt_tokens_details.cached_tokens or 0

    assert cached("minutes-1") == 0
    assert cached("minutes-1") >= 96
    assert cached("minutes-2") == 0


def test_fp32_greedy_over_http_equals_router_complete(front: Front) -> None:
    text = greedy(front, HELLO, 12)
    metadata = (("authorization", f"Bearer {KEY}"),)
    request = user_turn(HELLO[0]["content"], max_tokens=12, model=front.model)
    completed = router_stub(front.router).Complete(request, metadata=metadata, timeout=60)
    assert text == completed.text and text


def test_sdk_stream_with_usage_equals_the_whole_answer(front: Front) -> None:
    whole = greedy(front, HELLO, 10)
    chunks = list(
        front.client().chat.completions.create(
            model=front.model,
            messages=HELLO,  # type: ignore[arg-type]
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


async def test_async_sdk_streams_and_answers_whole(front: Front) -> None:
    client = openai.AsyncOpenAI(base_url=front.v1, api_key=KEY, max_retries=0)
    async with client:
        whole, stream = await asyncio.gather(
            client.chat.completions.create(model=front.model, messages=HELLO, max_tokens=8, temperature=0),  # type: ignore[arg-type]
            client.chat.completions.create(
                model=front.model,
                messages=HELLO,  # type: ignore[arg-type]
                max_tokens=8,
                temperature=0,
                stream=True,
            ),
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == whole.choices[0].message.content


def test_n_choices_are_indexed_seeded_and_differ(front: Front) -> None:
    create = front.client().chat.completions.create
    answer = create(model=front.model, messages=HELLO, max_tokens=12, temperature=1.0, seed=7, n=3)  # type: ignore[arg-type]
    assert [c.index for c in answer.choices] == [0, 1, 2]
    texts = [c.message.content for c in answer.choices]
    assert len(set(texts)) >= 2, texts
    assert answer.usage is not None and answer.usage.completion_tokens == 36
    again = create(model=front.model, messages=HELLO, max_tokens=12, temperature=1.0, seed=7, n=3)  # type: ignore[arg-type]
    assert [c.message.content for c in again.choices] == texts  # seeded: reproducible
    streamed: dict[int, str] = {0: "", 1: ""}
    for chunk in create(
        model=front.model,
        messages=HELLO,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        n=2,
        stream=True,  # type: ignore[arg-type]
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[0], streamed[1]] == texts[:2]


def test_a_stop_list_ends_the_answer_before_the_stop_string(front: Front) -> None:
    text = greedy(front, HELLO, 16)
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    answer = front.client().chat.completions.create(
        model=front.model,
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
        stop=["never-appears", stop],
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == text[: text.index(stop)]
    # vLLM's include_stop_str_in_output keeps the stop string at the end, whole and streamed.
    kept = {"model": front.model, "messages": HELLO, "max_tokens": 16, "temperature": 0, "stop": [stop]}
    extra = {"include_stop_str_in_output": True}
    whole = front.client().chat.completions.create(**kept, extra_body=extra)  # type: ignore[call-overload]
    assert whole.choices[0].message.content == text[: text.index(stop) + len(stop)]
    streamed = front.client().chat.completions.create(**kept, extra_body=extra, stream=True)  # type: ignore[call-overload]
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == whole.choices[0].message.content
    )


def test_legacy_completions_answer_each_prompt(front: Front) -> None:
    client = front.client()
    answer = client.completions.create(
        model=front.model, prompt=["Hello", "Goodbye"], max_tokens=4, temperature=0
    )
    assert [c.index for c in answer.choices] == [0, 1]
    assert all(c.text and c.finish_reason == "length" for c in answer.choices)
    assert answer.object == "text_completion" and answer.usage is not None
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=front.model, prompt="Hello", max_tokens=4, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == answer.choices[0].text


def test_logit_bias_and_penalties_change_the_answer_and_are_not_served_a_plain_ones_cache(
    front: Front, hf_tokenizer: Any
) -> None:
    client = front.client()
    prompt = "Repeat after me: the cat, the cat, the cat, the cat, the cat,"
    ask = {"model": front.model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    free = client.completions.create(**ask).choices[0].text
    assert client.completions.create(**ask).choices[0].text == free  # greedy: the same (cached) answer
    penalised = client.completions.create(**ask, frequency_penalty=2.0, presence_penalty=1.0).choices[0].text
    assert penalised != free, "a penalised request must not get the plain request's (cached) answer"
    (zebra,) = hf_tokenizer.encode(" zebra")[:1]
    forced = client.completions.create(**{**ask, "max_tokens": 3}, logit_bias={str(zebra): 100})
    assert forced.choices[0].text == hf_tokenizer.decode([zebra] * 3)
    # vLLM's stop_token_ids: the forced token ends the answer at once, its text left out.
    stopped = client.completions.create(
        **{**ask, "max_tokens": 3}, logit_bias={str(zebra): 100}, extra_body={"stop_token_ids": [zebra]}
    )
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("", "stop")
    # vLLM's allowed_token_ids: one allowed token is all the answer can be.
    only = client.completions.create(**{**ask, "max_tokens": 3}, extra_body={"allowed_token_ids": [zebra]})
    assert only.choices[0].text == hf_tokenizer.decode([zebra] * 3)
    # vLLM's bad_words outweighs even a +100 bias: the word is never written.
    clean = client.completions.create(
        **{**ask, "max_tokens": 3}, logit_bias={str(zebra): 100}, extra_body={"bad_words": ["zebra"]}
    )
    assert "zebra" not in clean.choices[0].text and clean.usage is not None
    assert clean.usage.completion_tokens == 3
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    chat = client.chat.completions.create(
        model=front.model, messages=HELLO, max_tokens=3, temperature=0, logit_bias={str(zebra): 100}
    )
    assert chat.choices[0].message.content == hf_tokenizer.decode([zebra] * 3)


def test_min_tokens_keeps_an_answer_going_past_where_it_would_end(front: Front) -> None:
    client = front.client()
    ask = {"model": front.model, "messages": [{"role": "user", "content": "What is 2+2?"}], "temperature": 0}
    free = client.chat.completions.create(**ask, max_tokens=64)
    assert free.choices[0].finish_reason == "stop" and free.usage is not None
    least = free.usage.completion_tokens + 6
    held = client.chat.completions.create(**ask, max_tokens=64, extra_body={"min_tokens": least})
    assert held.usage is not None and held.usage.completion_tokens >= least
    content = held.choices[0].message.content or ""
    assert content.startswith((free.choices[0].message.content or "").rstrip(".")) and len(content) > len(
        free.choices[0].message.content or ""
    )


def test_legacy_completions_continue_the_raw_prompt_without_a_chat_template(front: Front) -> None:
    client = front.client()
    text = "The capital of France is"
    raw = client.completions.create(model=front.model, prompt=text, max_tokens=6, temperature=0)
    chat = client.chat.completions.create(
        model=front.model, messages=[{"role": "user", "content": text}], max_tokens=6, temperature=0
    )
    assert raw.usage is not None and chat.usage is not None
    # The chat template wraps the text in a system prompt and role markers; a raw prompt is its own tokens.
    assert raw.usage.prompt_tokens <= len(text.split()) + 2 < chat.usage.prompt_tokens
    # The same raw prompt over gRPC (ChatRequest.prompt) gives the same greedy continuation.
    request = router_pb2.ChatRequest(
        prompt=text, sampling=common_pb2.SamplingParams(max_tokens=6, temperature=0.0)
    )
    reply = router_stub(front.router).Complete(
        request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60
    )
    assert reply.text == raw.choices[0].text and reply.end.usage.prompt_tokens == raw.usage.prompt_tokens
    both = router_pb2.ChatRequest(prompt=text, messages=[common_pb2.ChatMessage(role="user", content=text)])
    with pytest.raises(grpc.RpcError) as refused:
        router_stub(front.router).Complete(both, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in refused.value.details()
    with_session = front.post(
        "/v1/completions", {"model": front.model, "prompt": text, "max_tokens": 2, "session_id": "s-raw"}
    )
    assert with_session.status_code == 400 and with_session.json()["error"]["param"] == "session_id"


def test_a_prompt_of_token_ids_is_prefilled_as_given(front: Front, hf_tokenizer: Any) -> None:
    # lm-evaluation-harness's `local-completions` and SGLang's bench send prompts as token ids.
    tokenizer = hf_tokenizer
    client = front.client()
    text = "The capital of France is"
    ids = tokenizer.encode(text)
    by_text = client.completions.create(model=front.model, prompt=text, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=front.model, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text
    streamed = client.completions.create(
        model=front.model, prompt=ids, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == by_text.choices[0].text
    # Not tokenized again: five "a" tokens stay five, where the text "aaaaa" is fewer tokens.
    a = tokenizer.encode("a")
    assert len(a) == 1 and len(tokenizer.encode("aaaaa")) < 5
    several = client.completions.create(model=front.model, prompt=[a * 5, ids], max_tokens=6, temperature=0)
    assert several.usage is not None and several.usage.prompt_tokens == 5 + len(ids)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[1].text == by_text.choices[0].text
    # The same ids over gRPC (ChatRequest.prompt_token_ids) give the same continuation.
    metadata = (("authorization", f"Bearer {KEY}"),)
    request = router_pb2.ChatRequest(
        prompt_token_ids=ids, sampling=common_pb2.SamplingParams(max_tokens=6, temperature=0.0)
    )
    reply = router_stub(front.router).Complete(request, metadata=metadata, timeout=60)
    assert reply.text == by_text.choices[0].text and reply.end.usage.prompt_tokens == len(ids)
    both = router_pb2.ChatRequest(prompt=text, prompt_token_ids=ids)
    with pytest.raises(grpc.RpcError) as refused:
        router_stub(front.router).Complete(both, metadata=metadata, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in refused.value.details()
    # An id past the vocabulary: the replica's 400, naming the request's own field and the bound.
    vocab = len(tokenizer)
    outside = front.post("/v1/completions", {"model": front.model, "prompt": [[*ids], [1, vocab + 7]]})
    error = outside.json()["error"]
    assert outside.status_code == 400 and error["param"] == "prompt", error
    assert str(vocab + 7) in error["message"], error
    assert greedy(front, [{"role": "user", "content": "hi"}], 2), "the front still answers"


def test_echo_scores_the_prompt_as_an_evaluation_harness_reads_it(
    front: Front, hf_tokenizer: Any, reference_logprobs: Callable[[list[int]], torch.Tensor]
) -> None:
    # lm-evaluation-harness's loglikelihood request to `local-completions`: token ids, echo,
    # logprobs 1, max_tokens 1; it sums token_logprobs[context:-1] and checks each is the top one.
    tokenizer = hf_tokenizer
    context, continuation = tokenizer.encode("The capital of France is"), tokenizer.encode(" Paris")
    ids = context + continuation
    body = {
        "model": front.model,
        "prompt": [ids],
        "echo": True,
        "logprobs": 1,
        "max_tokens": 1,
        "temperature": 0,
    }
    answer = front.post("/v1/completions", body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1 and len(logprobs["token_logprobs"]) == len(ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = reference_logprobs(ids)
    for position in range(1, len(ids)):
        got = logprobs["token_logprobs"][position]
        assert got == pytest.approx(float(expected[position - 1, ids[position]]), abs=1e-4), position
        # The best alternative, and the token itself (OpenAI and vLLM list it too: logprobs + 1).
        top = logprobs["top_logprobs"][position]
        assert 1 <= len(top) <= 2 and top[logprobs["tokens"][position]] == got, position
        assert max(top.values()) == pytest.approx(float(expected[position - 1].max()), abs=1e-4), position
    assert "".join(logprobs["tokens"][: len(ids)]) == tokenizer.decode(ids)
    assert choice["text"].startswith(tokenizer.decode(ids)) and len(choice["text"]) > len(
        tokenizer.decode(ids)
    )
    assert answer.json()["usage"]["prompt_tokens"] == len(ids)
    # A text prompt is echoed as sent; without logprobs the echo is text alone.
    text = "The capital of France is"
    plain = front.post(
        "/v1/completions", {"model": front.model, "prompt": text, "echo": True, "max_tokens": 3}
    )
    assert plain.status_code == 200 and plain.json()["choices"][0]["logprobs"] is None
    assert plain.json()["choices"][0]["text"].startswith(text)
    # max_tokens 0 with echo scores the prompt alone (HELM's and OpenAI's old scoring request).
    scored = front.post("/v1/completions", {**body, "max_tokens": 0}).json()
    only = scored["choices"][0]
    assert only["text"] == tokenizer.decode(ids) and only["finish_reason"] == "length"
    assert only["logprobs"]["tokens"] == logprobs["tokens"][: len(ids)]
    assert only["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][: len(ids)]
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == len(ids)
    stream_only = list(
        front.client().completions.create(
            model=front.model,
            prompt=[ids],
            echo=True,
            max_tokens=0,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in stream_only if c.choices) == tokenizer.decode(ids)
    assert stream_only[-1].usage is not None and stream_only[-1].usage.completion_tokens == 0
    refused = front.post("/v1/completions", {"model": front.model, "prompt": "x", "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    # Characters whose bytes span tokens (most CJK ones and emoji in this vocabulary): the echo
    # is the ids decoded as one text, as vLLM's is, while each token (logprobs' tokens) is its own
    # text, or, a part of a character, its bytes as OpenAI names them ("bytes:\\xe4\\xbc").
    wide = tokenizer.encode("会话状态保存在 Redis 中 🌍")
    assert "".join(tokenizer.decode([i]) for i in wide) != tokenizer.decode(wide)  # split characters
    for streamed in (False, True):
        reply = front.client().completions.create(
            model=front.model, prompt=[wide], echo=True, logprobs=0, max_tokens=0, stream=streamed
        )
        chunks = list(reply) if streamed else [reply]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "会话状态保存在 Redis 中 🌍"
        tokens = [
            t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
        ]
        assert tokens == [_openai_token_name(tokenizer, i) for i in wide]
    # Streamed, the prompt comes first, with the first token, in one event (the SDK reads it).
    chunks = list(
        front.client().completions.create(
            model=front.model, prompt=[ids], echo=True, logprobs=1, max_tokens=3, temperature=0, stream=True
        )
    )
    whole = front.post("/v1/completions", {**body, "max_tokens": 3}).json()["choices"][0]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole["text"]
    streamed_tokens = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
    ]
    assert streamed_tokens == whole["logprobs"]["tokens"]
    first = next(c for c in chunks if c.choices).choices[0].logprobs
    assert first is not None and first.token_logprobs[0] is None
    assert first.token_logprobs[1:] == pytest.approx(
        whole["logprobs"]["token_logprobs"][1 : len(first.token_logprobs)]
    )


def _openai_token_name(tokenizer: Any, token_id: int) -> str:
    """A token as OpenAI's legacy completions name it: its text, or, if its bytes are no whole
    UTF-8 characters, ``bytes:`` and each byte as ``\\xNN`` (its bytes from GPT-2's alphabet)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = {char: byte for byte, char in bytes_to_unicode().items()}
    raw = bytes(alphabet[char] for char in tokenizer.convert_ids_to_tokens(token_id))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _joined_bytes(content: Any) -> bytes:
    return b"".join(bytes(t.bytes or []) for t in content)


def test_logprobs_bytes_of_an_emoji_and_cjk_answer_join_into_its_utf8(front: Front) -> None:
    # Characters whose bytes span tokens: each such token's text is U+FFFD, and its `bytes` were
    # U+FFFD's too ([239, 191, 189]), so joining them gave "������", not the answer (what OpenAI
    # says the field is for). They are the token's own bytes now, whole and streamed: the model
    # repeats the emoji and CJK (17 tokens end on a whole character), or a choice forces them.
    ask: dict[str, Any] = {
        "model": front.model,
        "messages": [{"role": "user", "content": "Repeat exactly: 🌊🌊 水色"}],
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    for extra, max_tokens, expected in (
        ({}, 17, "Repeat exactly: 🌊🌊 水色\n\n"),
        ({"guided_choice": ["🌊🌊 水色"]}, 32, "🌊🌊 水色"),
    ):
        whole = front.client().chat.completions.create(**ask, max_tokens=max_tokens, extra_body=extra)
        (choice,) = whole.choices
        assert choice.message.content == expected
        assert choice.logprobs is not None and choice.logprobs.content is not None
        content = choice.logprobs.content
        assert _joined_bytes(content) == expected.encode("utf-8")
        assert sum(t.token == "\ufffd" for t in content) >= 6  # text fields as they were
        assert all(t.bytes != [239, 191, 189] for t in content)
        for t in content:  # each alternative's bytes are its own too: decodable ones are its text
            for alt in t.top_logprobs:
                raw = bytes(alt.bytes or [])
                assert raw.decode("utf-8", "replace") == alt.token
            assert t.top_logprobs[0].bytes == t.bytes  # greedy: the best alternative is the token
        streamed = front.client().chat.completions.create(
            **ask, max_tokens=max_tokens, extra_body=extra, stream=True
        )
        tokens = [
            t
            for c in streamed
            if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content or []
        ]
        assert _joined_bytes(tokens) == expected.encode("utf-8")


def test_legacy_top_logprobs_keep_each_byte_token_under_openais_bytes_name(front: Front) -> None:
    # `top_logprobs` is a dict keyed by the token: every piece of a split character had the key
    # "\ufffd", so logprobs 5 gave 1 alternative. Such a token is named by its bytes, as OpenAI
    # names it ("bytes:\\xf0\\x9f"), in `tokens` and in the keys alike.
    body = {
        "model": front.model,
        "prompt": "🌊🌊",
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": 5,
        "echo": True,
    }
    answer = front.post("/v1/completions", body)
    assert answer.status_code == 200, answer.text
    logprobs = answer.json()["choices"][0]["logprobs"]
    tokens, tops = logprobs["tokens"], logprobs["top_logprobs"]
    assert tokens[:6] == ["bytes:\\xf0\\x9f", "bytes:\\x8c", "bytes:\\x8a"] * 2
    for position in range(1, len(tokens)):
        top = tops[position]
        assert 5 <= len(top) <= 6, (position, top)  # the 5 asked for, and the chosen one if not among them
        assert top[tokens[position]] == logprobs["token_logprobs"][position], position
    spelled = b"".join(
        bytes.fromhex(t.removeprefix("bytes:").replace("\\x", "")) if t.startswith("bytes:") else t.encode()
        for t in tokens[:6]
    )
    assert spelled == "🌊🌊".encode()


LM_EVAL_TASKS = {
    # A loglikelihood task (each choice scored with echo + logprobs over token ids) and a
    # generation task (token-id prompts, greedy, stop strings), as lm-eval's own YAML.
    "mesh_choice": """task: mesh_choice
dataset_path: json
dataset_kwargs: {data_files: {test: DATA}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc}]
""",
    "mesh_generate": """task: mesh_generate
dataset_path: json
dataset_kwargs: {data_files: {test: DATA}}
test_split: test
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{gold}}"
generation_kwargs: {until: ["\\n", "."], max_gen_toks: 6, do_sample: false}
metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]
""",
}
LM_EVAL_DOCS = [
    {
        "question": "The capital of France is",
        "choices": ["Paris", "Berlin", "Madrid"],
        "answer": 0,
        "gold": " Paris",
    },
    {
        "question": "Water freezes at zero degrees",
        "choices": ["Celsius", "volts"],
        "answer": 0,
        "gold": " Celsius",
    },
]


def test_lm_evaluation_harness_scores_and_generates_through_the_front(
    front: Front,
    model_path: Path,
    hf_tokenizer: Any,
    reference_logprobs: Callable[[list[int]], torch.Tensor],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The harness itself, as `lm_eval --model local-completions` runs it: its requests, its parsing.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in LM_EVAL_DOCS))
    for name, text in LM_EVAL_TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(text.replace("DATA", str(data)))
    args = (
        f"model={front.model},base_url={front.v1}/completions,tokenizer={model_path},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"
    )
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=list(LM_EVAL_TASKS),
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    assert out is not None
    tokenizer = hf_tokenizer
    scored = 0
    for sample in out["samples"]["mesh_choice"]:
        for (context, continuation), ((loglikelihood, _greedy),) in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            context_ids, continuation_ids = tokenizer.encode(context), tokenizer.encode(continuation)
            expected = reference_logprobs(context_ids + continuation_ids)
            want = sum(float(expected[len(context_ids) - 1 + j, t]) for j, t in enumerate(continuation_ids))
            assert loglikelihood == pytest.approx(want, abs=1e-3), (context, continuation)
            scored += 1
    assert scored == sum(len(doc["choices"]) for doc in LM_EVAL_DOCS)
    client = front.client()
    for sample in out["samples"]["mesh_generate"]:
        (generated,) = sample["resps"][0]
        question = sample["doc"]["question"]
        # The same greedy continuation as asked directly, cut at the task's stop strings.
        direct = client.completions.create(
            model=front.model, prompt=question, max_tokens=6, temperature=0, stop=["\n", "."]
        )
        assert generated == direct.choices[0].text, question


JAVA_CLIENT = Path(__file__).resolve().parents[1] / "support" / "java" / "OpenAiJdkClient.java"


def test_javas_http_client_proposing_h2c_gets_its_answers_whole_and_streamed(front: Front) -> None:
    """LangChain4j's and Spring's default HTTP client: every new connection proposes h2c, and
    uvicorn's httptools parser used to drop such a request's body (a 400 for every request)."""
    java = shutil.which("java")
    assert java, (
        "needs a JDK (Debian's openjdk-17-jdk-headless): the client of the Spring AI and LangChain4j apps"
    )
    ran = subprocess.run(
        [java, str(JAVA_CLIENT), front.v1, front.model],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OPENAI_API_KEY": KEY},
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    first, second, streamed = ran.stdout.splitlines()
    answers = []
    for line in (first, second):
        version, status, body = line.split(" ", 2)
        assert (version, status) == ("HTTP_1_1", "200"), line
        answers.append(json.loads(body)["choices"][0]["message"]["content"])
    # Greedy, the same request twice (the second on the connection the first proposed h2c on).
    assert answers[0] and answers[0] == answers[1]
    version, status, events = streamed.split(" ", 2)
    assert (version, status) == ("HTTP_1_1", "200"), streamed
    data = [e.removeprefix("data: ") for e in events.split("\\n") if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert "".join(
        c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, data[:-1]) if c["choices"]
    )


NODE_CLIENT = Path(__file__).resolve().parents[1] / "support" / "node"


@pytest.fixture(scope="module")
def node_sdk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The official OpenAI Node SDK at the version the lock file pins, installed once (~3 s)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "needs Node.js and npm (Debian's nodejs, npm): the client of JavaScript apps"
    folder = tmp_path_factory.mktemp("node-client")
    for name in ("package.json", "package-lock.json", "openai_client.mjs"):
        shutil.copy(NODE_CLIENT / name, folder / name)
    done = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund", "--silent"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return folder


def test_the_openai_node_sdk_answers_streams_and_reads_errors(front: Front, node_sdk: Path) -> None:
    ran = subprocess.run(
        ["node", "openai_client.mjs", front.v1, front.model],
        cwd=node_sdk, capture_output=True, text=True, timeout=180, env={**os.environ, "OPENAI_API_KEY": KEY},
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    got = json.loads(ran.stdout)
    assert got["whole"] and got["finish"] == "length" and got["usage"]["completion_tokens"] == 12
    # Greedy: the stream spells the whole answer, and its last chunk carries its usage (the
    # prompt now comes from the prefix cache: cached_tokens may differ).
    assert got["streamed"] == got["whole"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [got["streamUsage"][k] for k in counts] == [got["usage"][k] for k in counts]
    assert [index for index, _ in got["choices"]] == [0, 1] and all(text for _, text in got["choices"])
    assert got["refused"] == {
        "name": "BadRequestError", "status": 400, "param": "temperature", "code": "invalid_value"
    }  # fmt: skip


def test_curl_http2_proposing_h2c_is_answered_in_http_1_1(front: Front) -> None:
    body = json.dumps({"model": front.model, "messages": HELLO, "max_tokens": 4, "temperature": 0})
    ran = subprocess.run(
        ["curl", "-s", "--http2", "-w", "\\n%{http_code} %{http_version}", f"{front.v1}/chat/completions",
         "-H", f"authorization: Bearer {KEY}", "-H", "content-type: application/json", "-d", body],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    answer, status = ran.stdout.rsplit("\n", 1)
    assert status == "200 1.1", ran.stdout
    assert json.loads(answer)["choices"][0]["message"]["content"]


def test_an_h2c_proposal_whose_body_comes_in_pieces_is_read_whole_and_the_connection_serves_on(
    front: Front,
) -> None:
    """The body after an ignored upgrade's headers may arrive in later packets, and a next request
    may follow it on the same connection: both reach the app whole."""
    body = json.dumps({"model": front.model, "messages": HELLO, "temperature": 9}).encode()
    host, port = front.base.removeprefix("http://").rsplit(":", 1)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    following = f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for piece in (head, body[:10], body[10:] + following):
            sock.sendall(piece)
            time.sleep(0.2)
        received = b""
        while received.count(b"HTTP/1.1 ") < 2 or not received.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    first, second = received.split(b"HTTP/1.1 ")[1:]
    # The body was read: the error names its field, not "not valid JSON".
    assert first.startswith(b"400 ") and b'"param":"temperature"' in first, first
    assert second.startswith(b"200 ") and front.model.encode() in second, second


def test_models_list_and_get(front: Front) -> None:
    client = front.client()
    assert [m.id for m in client.models.list()] == [front.model]
    assert client.models.retrieve(front.model).id == front.model


# -- LangChain


def test_langchain_chat_openai_invokes_and_streams(front: Front) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=front.v1,
        api_key=KEY,
        model=front.model,
        max_tokens=10,
        temperature=0,
        max_retries=0,  # type: ignore[arg-type]
    )
    answer = llm.invoke(HELLO[0]["content"])
    assert answer.content == greedy(front, HELLO, 10)
    assert "".join(str(c.content) for c in llm.stream(HELLO[0]["content"])) == answer.content


# -- the Responses API (/v1/responses)

BRIEF = [{"role": "system", "content": "Be brief."}, *HELLO]


def test_the_responses_api_answers_as_chat_does_whole_and_streamed(front: Front) -> None:
    client = front.client()
    asked: dict[str, Any] = {
        "model": front.model,
        "instructions": "Be brief.",
        "input": HELLO[0]["content"],
        "max_output_tokens": 8,
        "temperature": 0,
    }
    chat = client.chat.completions.create(model=front.model, messages=BRIEF, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    expected = chat.choices[0].message.content
    whole = client.responses.create(**asked)
    assert whole.id.startswith("resp_") and whole.output_text == expected
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage is not None and chat.usage is not None
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    with client.responses.stream(**asked) as stream:
        events = list(stream)
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert [e.type for e in events[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == expected == events[-1].response.output_text  # type: ignore[union-attr]
    # An answer that ends by itself is completed, and the SDK's stream helper hands it over.
    said = [{"role": "user", "content": "Say OK."}]
    with client.responses.stream(
        model=front.model, input=said, max_output_tokens=40, temperature=0
    ) as stream:  # type: ignore[arg-type]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == greedy(front, said, 40)


def test_the_responses_api_parses_structured_output_and_gives_logprobs(front: Front) -> None:
    from typing import Literal

    from pydantic import BaseModel

    class Colour(BaseModel):
        name: Literal["red", "green", "blue"]
        warm: bool

    client = front.client()
    parsed = client.responses.parse(
        model=front.model, input="Pick a colour.", text_format=Colour, max_output_tokens=30, temperature=0
    )
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Colour)
    scored = client.responses.create(
        model=front.model,
        input="Hi",
        max_output_tokens=4,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    part = scored.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs and "".join(t.token for t in part.logprobs) == scored.output_text  # type: ignore[union-attr]
    for token in part.logprobs:  # type: ignore[union-attr]
        assert len(token.top_logprobs or []) == 2
        # Greedy: the token drawn is the likeliest one.
        assert token.top_logprobs is not None and token.token == token.top_logprobs[0].token
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)


def test_langchain_on_the_responses_api_invokes_streams_and_sends_its_answer_back(front: Front) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=front.v1,
        api_key=KEY,
        model=front.model,
        use_responses_api=True,
        max_tokens=8,
        temperature=0,
        max_retries=0,  # type: ignore[arg-type]
    )
    asked = [SystemMessage("Be brief."), HumanMessage(HELLO[0]["content"])]
    answer = llm.invoke(asked)
    assert answer.text == greedy(front, BRIEF, 8)
    assert "".join(c.text for c in llm.stream(asked)) == answer.text
    # The answer goes back as LangChain sends it: a typed output message with its id.
    follow = llm.invoke([*asked, answer, HumanMessage("And two more?")])
    history = [
        *BRIEF,
        {"role": "assistant", "content": answer.text},
        {"role": "user", "content": "And two more?"},
    ]
    assert follow.text == greedy(front, history, 8)
    # A forced tool call through bind_tools: LangChain reads the function_call item as a tool call.
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=16)

    roomy = llm.model_copy(update={"max_tokens": 48})
    caller = roomy.bind_tools([GetWeather], tool_choice="GetWeather", strict=True)
    called = caller.invoke("What is the weather in Paris?")
    (tool_call,) = called.tool_calls  # type: ignore[attr-defined]
    assert tool_call["name"] == "GetWeather" and isinstance(tool_call["args"]["city"], str)
    # The tool's result goes back as LangChain sends it (function_call + function_call_output
    # items), and the answer is the one chat gives for that history.
    from langchain_core.messages import ToolMessage

    answered = roomy.invoke(
        ["What is the weather in Paris?", called, ToolMessage("sunny", tool_call_id=tool_call["id"])]
    )
    chat_call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "GetWeather", "arguments": json.dumps(tool_call["args"])},
    }
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert answered.text and answered.text == greedy(front, history, 48)  # type: ignore[arg-type]


def forced_call(front: Front, tool: Any, name: str) -> Any:
    """The greedy answer to "What is the weather in Paris?", forced to be a call of ``name``."""
    return front.client().chat.completions.create(
        model=front.model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=48,
        temperature=0,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": name}},
    )


def test_the_responses_api_makes_a_forced_function_call_as_chat_does(front: Front) -> None:
    import openai
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: str = Field(max_length=16)

    chat_tool = openai.pydantic_function_tool(GetWeather)
    tool = openai.pydantic_responses_function_tool(GetWeather)
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    client = front.client()
    chat = forced_call(front, chat_tool, "GetWeather")
    (expected,) = chat.choices[0].message.tool_calls or []
    named = {"type": "function", "name": "GetWeather"}
    call_asked: dict[str, Any] = {
        "model": front.model,
        "input": asked,
        "max_output_tokens": 48,
        "temperature": 0,
        "tools": [tool],
    }
    whole = client.responses.create(**call_asked, tool_choice=named)
    (call,) = whole.output
    assert whole.status == "completed" and call.type == "function_call"
    assert (call.name, call.arguments) == ("GetWeather", expected.function.arguments)  # type: ignore[union-attr]
    assert call.call_id and whole.output_text == ""
    with client.responses.stream(**call_asked, tool_choice=named) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events[2:]] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (streamed,) = final.output
    assert streamed.arguments == call.arguments  # type: ignore[union-attr]
    # The SDK's parse helper reads the arguments into the tool's own model; `required` names it.
    parsed = client.responses.parse(**{**call_asked, "max_output_tokens": 60}, tool_choice="required")
    (made,) = parsed.output
    assert made.type == "function_call" and made.name == "GetWeather"
    assert isinstance(made.parsed_arguments, GetWeather)  # type: ignore[union-attr]
    # The call and its output given back, as the SDK has them: the answer chat gives for the same
    # history (one rendering for both APIs).
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}  # type: ignore[union-attr]
    answered = client.responses.create(
        model=front.model,
        input=[*asked, call, output],  # type: ignore[list-item]
        max_output_tokens=12,
        temperature=0,
    )
    history = [
        *asked,
        {"role": "assistant", "content": None, "tool_calls": [expected.model_dump()]},
        {"role": "tool", "tool_call_id": expected.id, "content": "sunny"},
    ]
    assert answered.output_text and answered.output_text == greedy(front, history, 12)  # type: ignore[arg-type]
    stray = {**output, "call_id": "call_nowhere"}
    refused = front.post("/v1/responses", {"model": front.model, "input": [*asked, stray]})
    assert_error(refused, 400, "input[1].call_id")


def test_the_responses_api_refuses_what_it_cannot_honour_naming_the_field(front: Front) -> None:
    def post(body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
        return front.post("/v1/responses", {"model": front.model, **body}, key=key)

    assert_error(post({"input": ""}), 400, "input")
    assert_error(post({"input": "x", "previous_response_id": "resp_1"}), 400, "previous_response_id")
    assert_error(post({"input": "x", "tools": [{"type": "web_search"}]}), 400, "tools[0].type")
    weather = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
    assert_error(post({"input": "x", "tools": [weather]}), 400, "tool_choice", code="unsupported_parameter")
    assert_error(
        post({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
        400,
        "input[0].content[0].type",
    )
    assert_error(post({"input": "x " * 9000}), 400, "input", code="context_length_exceeded")
    bad_schema = {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nonsense"}}}
    assert_error(post({"input": "x", "text": bad_schema}), 400, "text.format.schema")
    assert_error(post({"input": "x", "model": "nope"}), 404, "model")
    assert_error(post({"input": "x"}, key=None), 401)
    stored = httpx.get(f"{front.v1}/responses/resp_1", headers={"authorization": f"Bearer {KEY}"})
    assert_error(stored, 404, "response_id", code="response_not_found")


# -- raw SSE


def test_sse_events_are_data_lines_as_openais_and_end_with_done(front: Front) -> None:
    """No `id:` or comment lines in a stream that cannot be resumed: the load tools' readers
    (`vllm bench serve`, SGLang's bench_serving, llmperf) take each line as `data:` JSON."""
    body = {"model": front.model, "messages": HELLO, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST",
        f"{front.v1}/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read()
        request_id = response.headers["x-request-id"]
    assert load_tool_texts(raw)  # every line data (or a blank keep-alive), and an answer in them
    # Every event is one data line, then a blank line; keep-alives are blank lines between them.
    events = [e.strip("\n") for e in raw.decode().split("\n\n") if e.strip("\n")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    for event in events[:-1]:
        chunk = json.loads(event.removeprefix("data: "))
        assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == f"chatcmpl-{request_id}"


def _long_stream(front: Front, lines: list[str], opened: threading.Event, stop: threading.Event) -> None:
    """A stream long enough to hold a replica slot until ``stop``, then dropped mid-answer."""
    body = {
        "model": front.model,
        "messages": HELLO,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{front.v1}/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as response:
        for line in response.iter_lines():
            lines.append(line)
            if line.startswith("data:"):
                opened.set()
            if stop.is_set():
                return  # leaving the block closes the connection: the client has gone


def test_a_queued_stream_gets_keepalives_and_leaving_frees_the_replica(front: Front) -> None:
    stop = threading.Event()
    runs = []
    for _ in range(3):  # the replica runs 2 at once: the third waits in its queue
        lines: list[str] = []
        opened = threading.Event()
        thread = threading.Thread(target=_long_stream, args=(front, lines, opened, stop), daemon=True)
        runs.append((thread, lines, opened))
        thread.start()
        time.sleep(0.3 if len(runs) < 3 else 0)
    try:
        assert runs[0][2].wait(30) and runs[1][2].wait(30)
        time.sleep(1.0)
        queued = runs[2][1]
        # Its 200 has begun, with keep-alives (blank lines) and no event yet.
        assert queued and set(queued) == {""}, queued[:5]
        assert running_sequences(front.replica) == 3
    finally:
        stop.set()
        for thread, _, _ in runs:  # even after a failed assert: the next test needs a quiet replica
            thread.join(30)
    left_at = time.monotonic()
    while running_sequences(front.replica) and time.monotonic() - left_at < 5:
        time.sleep(0.02)
    assert running_sequences(front.replica) == 0
    assert time.monotonic() - left_at < 1.0


@pytest.mark.parametrize(
    "upgrade",
    [
        b"",
        b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n",
    ],
    ids=["http1.1", "proposing-h2c"],
)
def test_a_client_that_leaves_a_whole_answer_cancels_it(front: Front, upgrade: bytes) -> None:
    # Proposing h2c, the connection is served by h11 (http_protocol.py): leaving must cancel there too.
    body = json.dumps(
        {"model": front.model, "messages": HELLO, "max_tokens": 400, "ignore_eos": True}
    ).encode()
    host, port = front.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + upgrade
            + f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        started = time.monotonic()
        while running_sequences(front.replica) == 0 and time.monotonic() - started < 10:
            time.sleep(0.02)
        assert running_sequences(front.replica) == 1
    left_at = time.monotonic()
    while running_sequences(front.replica) and time.monotonic() - left_at < 5:
        time.sleep(0.02)
    assert time.monotonic() - left_at < 1.0


# -- errors: status and body for every row of the table


def assert_error(
    response: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_400_names_the_field(front: Front) -> None:
    chat = {"model": front.model, "messages": HELLO}
    assert_error(front.post("/v1/chat/completions", {**chat, "temperature": 9}), 400, "temperature")
    assert_error(
        front.post("/v1/chat/completions", {**chat, "tools": [{"type": "function"}]}), 400, "tools[0]"
    )
    assert_error(front.post("/v1/chat/completions", {**chat, "presence_penalty": 3}), 400, "presence_penalty")
    # Past this model's vocabulary: only the replica knows it, and its refusal names the field.
    error = assert_error(
        front.post("/v1/chat/completions", {**chat, "logit_bias": {"1000000": 5}}), 400, "logit_bias"
    )
    assert "1000000" in error["message"]
    assert_error(
        front.post("/v1/chat/completions", {**chat, "max_tokens": 1, "min_tokens": 2}), 400, "min_tokens"
    )
    # Without max_tokens the limit is what the context leaves: more than that, the replica's
    # refusal names min_tokens.
    assert_error(front.post("/v1/chat/completions", {**chat, "min_tokens": 9000}), 400, "min_tokens")
    assert_error(front.post("/v1/chat/completions", {**chat, "n": 9}), 400, "n")
    assert_error(front.post("/v1/chat/completions", {**chat, "echo": True}), 400, "echo")
    raw = httpx.post(
        f"{front.v1}/chat/completions", content=b"{not json", headers={"authorization": f"Bearer {KEY}"}
    )
    assert_error(raw, 400, code="invalid_json")
    with pytest.raises(openai.BadRequestError):
        front.client().chat.completions.create(model=front.model, messages=HELLO, top_logprobs=2)  # type: ignore[arg-type]


def test_a_conversation_over_the_context_is_context_length_exceeded_naming_what_to_shorten(
    front: Front,
) -> None:
    # ~9,000 tokens in under the front's 64 KiB body limit: more than the model's 8,192.
    long_text = " ".join(f"w{i % 97}" for i in range(9000))
    chat = front.post(
        "/v1/chat/completions", {"model": front.model, "messages": [{"role": "user", "content": long_text}]}
    )
    text = front.post("/v1/completions", {"model": front.model, "prompt": long_text, "max_tokens": 4})
    # A prompt that fits, with room asked for that the context does not have.
    room = front.post("/v1/chat/completions", {"model": front.model, "messages": HELLO, "max_tokens": 8190})
    # The same refusal names the field the client sent the limit in.
    room_completion = front.post(
        "/v1/chat/completions", {"model": front.model, "messages": HELLO, "max_completion_tokens": 8190}
    )
    room_output = front.post(
        "/v1/responses", {"model": front.model, "input": "Hi", "max_output_tokens": 8190}
    )

    # A chat request has no `prompt`: the error names its messages, as OpenAI's does.
    error = assert_error(chat, 400, "messages", "context_length_exceeded")
    assert error["message"].startswith("messages: ") and "8192-token context" in error["message"]
    assert_error(text, 400, "prompt", "context_length_exceeded")
    assert_error(room, 400, "max_tokens", "context_length_exceeded")
    error = assert_error(room_completion, 400, "max_completion_tokens", "context_length_exceeded")
    assert error["message"].startswith("max_completion_tokens: 8190 plus ")
    error = assert_error(room_output, 400, "max_output_tokens", "context_length_exceeded")
    assert error["message"].startswith("max_output_tokens: 8190 plus ")
    # What the SDK raises for it, with the code a client trims the conversation by.
    with pytest.raises(openai.BadRequestError) as raised:
        front.client().chat.completions.create(
            model=front.model, messages=[{"role": "user", "content": long_text}]
        )
    assert raised.value.code == "context_length_exceeded" and raised.value.param == "messages"


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema_answers_valid_json_with_openai_shaped_logprobs(front: Front) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    answer = front.client().chat.completions.create(
        model=front.model,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=64,
        temperature=0,  # type: ignore[arg-type]
        response_format=fmt,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert answer.usage is not None and len(content) == answer.usage.completion_tokens
    # At most 2 alternatives: fewer where the grammar allowed fewer tokens (a key's forced quote).
    assert all(1 <= len(t.top_logprobs) <= 2 and t.logprob <= 0 for t in content)
    assert any(len(t.top_logprobs) == 2 for t in content)
    # The chosen token is the most likely one the grammar allowed (greedy).
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5) for t in content)
    streamed = front.client().chat.completions.create(
        model=front.model,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=64,
        temperature=0,  # type: ignore[arg-type]
        response_format=fmt,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    chunks = [c for c in streamed if c.choices and c.choices[0].logprobs is not None]
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.content or [])]  # type: ignore[union-attr]
    assert [t.token for t in tokens] == [t.token for t in content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_json_object_and_a_bad_schema_over_http(front: Front) -> None:
    chat = {"model": front.model, "messages": HELLO, "max_tokens": 48, "temperature": 0}
    ok = front.post("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}})
    assert ok.status_code == 200, ok.text
    choice = ok.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    # The replica refuses naming its proto field; the client is told the field it sent.
    error = assert_error(
        front.post("/v1/chat/completions", {**chat, "response_format": bad}),
        400,
        "response_format.json_schema.schema",
    )
    assert error["message"].startswith("response_format.json_schema.schema: does not compile")
    assert_error(front.post("/v1/chat/completions", {**chat, "guided_regex": "a(b"}), 400, "guided_regex")
    # A choice no token can begin (SmolLM2 has no token for U+0016): refused at admission; one
    # that dead-ends after "a": that request ends alone, saying why. Both name guided_choice.
    for choice in (["\x16"], ["a\x16"]):
        error = assert_error(front.post("/v1/chat/completions", {**chat, "guided_choice": choice}), 400)
        assert error["param"] == "guided_choice" and error["message"].startswith("guided_choice: "), choice
    streamed = front.post("/v1/chat/completions", {**chat, "guided_choice": ["a\x16"], "stream": True})
    assert streamed.status_code == 200, streamed.text
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["param"] == "guided_choice", events[-1]
    assert_error(
        front.post(
            "/v1/chat/completions",
            {**chat, "tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]},
        ),
        400,
        "tool_choice",
        "unsupported_parameter",
    )


def test_a_named_tool_choice_answers_with_a_call_whose_arguments_fit_the_schema(front: Front) -> None:
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    answer = front.client().chat.completions.create(
        model=front.model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=48,
        temperature=0,  # type: ignore[arg-type]
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), parameters)  # type: ignore[union-attr]
    # A stop string ends the arguments at their first quote, before the grammar completes: no
    # call is claimed (it was `tool_calls` with arguments "{"), its text is the answer, whole
    # and streamed alike.
    for stream in (False, True):
        body = {
            "model": front.model,
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "max_tokens": 48,
            "temperature": 0,
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "stop": ['"'],
            "stream": stream,
        }
        if not stream:
            (cut,) = front.post("/v1/chat/completions", body).json()["choices"]
            assert cut["finish_reason"] == "stop" and "tool_calls" not in cut["message"]
            assert cut["message"]["content"] == "{"
        else:
            streamed = front.post("/v1/chat/completions", body)
            chunks = [
                json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
            ]
            deltas = [c["choices"][0] for c in chunks if c.get("choices")]
            assert not any("tool_calls" in d["delta"] for d in deltas)
            assert "".join(d["delta"].get("content") or "" for d in deltas) == "{"
            assert deltas[-1]["finish_reason"] == "stop"


def test_a_required_call_of_a_pydantic_tool_with_nested_models_compiles_and_streams_its_logprobs(
    front: Front,
) -> None:
    """A tool made from a pydantic model with a nested model refers to it by "#/$defs/…": joined
    into the `required` schema those pointers resolved against the join, a 400 for every such
    tool. And a streamed call dropped the logprobs the whole answer gives."""
    parameters = {
        "$defs": {
            "Unit": {
                "type": "object",
                "properties": {"name": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["name"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"$ref": "#/$defs/Unit"}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    body = {
        "model": front.model,
        "messages": [{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
        "max_tokens": 60,
        "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}],
        "tool_choice": "required",
        "logprobs": True,
    }
    whole = front.post("/v1/chat/completions", body)
    assert whole.status_code == 200, whole.text
    (choice,) = whole.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)
    streamed = front.post("/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    (called,) = [
        c["choices"][0] for c in chunks if c.get("choices") and "tool_calls" in c["choices"][0]["delta"]
    ]
    assert called["delta"]["tool_calls"][0]["function"] == call["function"]
    assert [t["token"] for t in called["logprobs"]["content"]] == [
        t["token"] for t in choice["logprobs"]["content"]
    ]


def test_a_tool_whose_parameters_are_no_object_is_refused_and_an_empty_one_takes_an_object(
    front: Front,
) -> None:
    """A function's arguments are a JSON object: `{"type": "string"}` made the forced call come
    back as text with finish_reason stop, never a call. `{}` now means any object."""

    def forced(parameters: dict) -> httpx.Response:
        return front.post("/v1/chat/completions", {
            "model": front.model, "messages": [{"role": "user", "content": "Run it."}],
            "max_tokens": 12, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "run", "parameters": parameters}}],
            "tool_choice": {"type": "function", "function": {"name": "run"}},
        })  # fmt: skip

    for wrong in ({"type": "string"}, {"type": "array", "items": {"type": "integer"}}):
        error = assert_error(forced(wrong), 400, param="tools[0].function.parameters")
        assert "JSON object" in error["message"]
    (choice,) = forced({}).json()["choices"]
    if choice["finish_reason"] == "tool_calls":  # 12 tokens may cut a long object short
        assert isinstance(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]), dict)
    else:
        assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")


def test_a_call_and_its_result_given_back_get_the_answer_the_model_reads_from_them(
    front: Front, hf_tokenizer: Any
) -> None:
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
    }
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": weather}}
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    client = front.client()
    first = forced_call(front, tool, "get_weather")
    message = first.choices[0].message
    (call,) = message.tool_calls or []
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "clear"}'}
    final = client.chat.completions.create(
        model=front.model,
        messages=[*asked, message, result],  # type: ignore[list-item]  # the SDK's message, as given
        max_tokens=16,
        temperature=0,
    )
    # What the model read: the template over the call, as the engine writes a `required` one,
    # and the result in a tool turn; the same prompt sent as token ids gets the same answer.
    as_written = {"name": call.function.name, "arguments": json.loads(call.function.arguments)}  # type: ignore[union-attr]
    rendered = hf_tokenizer.apply_chat_template(
        [
            *asked,
            {"role": "assistant", "content": json.dumps(as_written)},
            {"role": "tool", "content": result["content"]},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = hf_tokenizer.encode(rendered, add_special_tokens=False)
    expected = client.completions.create(model=front.model, prompt=ids, max_tokens=16, temperature=0)
    assert final.usage is not None and final.usage.prompt_tokens == len(ids)
    assert final.choices[0].message.content == expected.choices[0].text
    # A result must answer a call made before it.
    stray = {**result, "tool_call_id": "call_nowhere"}
    refused = front.post("/v1/chat/completions", {"model": front.model, "messages": [*asked, stray]})
    assert_error(refused, 400, "messages[1].tool_call_id")


def test_nulls_and_load_tool_extras_are_served(front: Front) -> None:
    body = {
        "model": front.model,
        "messages": HELLO,
        "max_tokens": 2,
        "temperature": None,
        "stop": None,
        "tools": None,
        "ignore_eos": True,
        "min_tokens": 0,
        "stream_options": {"include_usage": False, "continuous_usage_stats": True},
        "an_unknown_field": [1, 2],
    }
    response = front.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_401_without_a_valid_key(front: Front) -> None:
    for key in (None, "sk-wrong", REVOKED_KEY):
        assert_error(
            front.post("/v1/chat/completions", {"messages": HELLO}, key=key), 401, code="invalid_api_key"
        )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=front.v1, api_key="sk-wrong", max_retries=0).models.list()
    # Told in HTTP's words (it said "send metadata 'authorization: …'", gRPC's).
    missing = front.post("/v1/chat/completions", {"messages": HELLO}, key=None).json()["error"]["message"]
    assert "the header 'Authorization: Bearer <api key>'" in missing, missing


def test_404_for_an_unknown_model_lists_the_served_ones(front: Front) -> None:
    error = assert_error(
        front.post("/v1/chat/completions", {"model": "nope", "messages": HELLO}),
        404,
        "model",
        "model_not_found",
    )
    assert front.model in error["message"]
    got = httpx.get(f"{front.v1}/models/nope", headers={"authorization": f"Bearer {KEY}"})
    assert front.model in assert_error(got, 404, "model", "model_not_found")["message"]
    with pytest.raises(openai.NotFoundError):
        front.client().chat.completions.create(model="nope", messages=HELLO, stream=True)  # type: ignore[arg-type]
    assert_error(httpx.get(f"{front.base}/v1/nowhere"), 404)
    assert_error(httpx.get(f"{front.v1}/chat/completions"), 405)


def test_413_for_a_body_over_the_limit(front: Front) -> None:
    huge = {"model": front.model, "messages": [{"role": "user", "content": "x" * 70_000}]}
    assert_error(front.post("/v1/chat/completions", huge), 413, code="request_too_large")


def test_429_with_retry_after_when_the_key_is_over_its_rate(front: Front) -> None:
    body = {"model": front.model, "messages": HELLO, "max_tokens": 1}
    # More choices than the key's burst of 1 could never be admitted: a 400 on n, which spends
    # nothing (it was a 429 a client retried forever, each try spending the key's one request).
    too_many = front.post("/v1/chat/completions", {**body, "n": 2}, key=LIMITED_KEY)
    assert_error(too_many, 400, param="n")
    assert "burst of 1" in too_many.json()["error"]["message"]
    assert front.post("/v1/chat/completions", body, key=LIMITED_KEY).status_code == 200
    refused = front.post("/v1/chat/completions", body, key=LIMITED_KEY)
    assert_error(refused, 429, code="rate_limit_exceeded")
    assert int(refused.headers["retry-after"]) >= 1
    streamed = front.post("/v1/chat/completions", {**body, "stream": True}, key=LIMITED_KEY)
    assert_error(streamed, 429)  # before any token: a status, not a 200 stream


def test_504_when_the_deadline_passes(front: Front) -> None:
    body = {"model": front.model, "messages": HELLO, "max_tokens": 300, "ignore_eos": True}
    started = time.monotonic()
    late = front.post("/v1/chat/completions", body, headers={"x-request-timeout": "0.3"})
    assert_error(late, 504, code="timeout")
    assert time.monotonic() - started < 5
    assert_error(front.post("/v1/chat/completions", body, headers={"x-request-timeout": "soon"}), 400)


def test_503_when_no_replica_can_serve(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # closed again before the router dials it
    router = ServiceProcess(
        "services.router", ["--replicas", dead, "--http-port", "0", "--health-interval-s", "0.2"]
    )
    with router.start():
        base = http_base(router)
        body = {"model": "any", "messages": HELLO}
        assert_error(httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30), 503)
        assert_error(httpx.get(f"{base}/health"), 503)


def _http_counter(front: Front, route: str, status: int) -> float:
    page = httpx.get(f"http://127.0.0.1:{front.router.metrics_port}/metrics", timeout=5).text
    wanted = f'llmmesh_router_http_requests_total{{route="{route}",status="{status}"}} '
    return sum(float(line.split()[-1]) for line in page.splitlines() if line.startswith(wanted))


def test_http_metrics_count_requests_by_route_and_status(front: Front) -> None:
    before = _http_counter(front, "/v1/chat/completions", 401)
    for _ in range(2):
        front.post("/v1/chat/completions", {"messages": HELLO}, key="sk-wrong")
    httpx.get(f"{front.base}/v1/models/a/b/c", headers={"authorization": f"Bearer {KEY}"})
    assert _http_counter(front, "/v1/chat/completions", 401) == before + 2
    assert _http_counter(front, "/v1/models/{model}", 404) >= 1  # the path itself is never a label


def test_the_router_still_answers_grpc_beside_http(front: Front) -> None:
    stub = router_stub(front.router)
    listed = stub.ListReplicas(
        router_pb2.ListReplicasRequest(), metadata=(("authorization", f"Bearer {KEY}"),), timeout=5
    )
    assert [r.model for r in listed.replicas] == [front.model]
    with pytest.raises(grpc.RpcError):
        stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5)  # no key: refused there too


# -- random JSON at every endpoint

_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    # JSON integers have no bound: past float's range (an OverflowError once), past 64 bits.
    | st.sampled_from([10**400, -(10**400), 2**64, 2**31])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
_JSON = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_FIELDS = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "tools",
        "response_format",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "min_p",
        "stop_token_ids",
        "include_stop_str_in_output",
        "allowed_token_ids",
        "bad_words",
        "rag",
        "cache",
        "min_tokens",
        "ignore_eos",
        "echo",
        "input",
        "instructions",
        "max_output_tokens",
        "text",
        "include",
    ]
) | st.text(max_size=10)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | _LEAVES, "content": _JSON}
)
_BODIES = (
    st.dictionaries(_FIELDS, _JSON, max_size=8)
    | st.fixed_dictionaries({"messages": st.lists(_MESSAGE, max_size=3)}, optional={"stream": st.booleans()})
    | st.fixed_dictionaries({"prompt": _JSON}, optional={"n": _LEAVES, "stream": st.booleans()})
    | st.fixed_dictionaries(
        {"input": _JSON | st.lists(_MESSAGE, max_size=3)},
        optional={"instructions": _JSON, "text": _JSON, "stream": st.booleans()},
    )
    | _JSON
)


def _bounded(body: object) -> object:
    """Random bodies that happen to be valid answer in one token: the test is about input, not length."""
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(name)
            if name in ("max_tokens", "max_output_tokens") or (
                isinstance(value, int) and not isinstance(value, bool) and value > 1
            ):
                body[name] = 1
    return body


@given(
    route=st.sampled_from(
        [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/embeddings",
            "/v1/models",
            "/health",
            "/v1/embed",
        ]
    ),
    body=_BODIES,
    model=st.text(max_size=12),
)
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_json_gets_a_4xx_in_openai_shape_never_a_500(
    front: Front, route: str, body: object, model: str
) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=front.base, headers=headers, timeout=60) as client:
        response = client.post(route, json=_bounded(body))
        fetched = client.get(f"/v1/models/{quote(model, safe='')}") if model else None
    for r in (response, fetched):
        if r is None:
            continue
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, r.text
        elif r.headers["content-type"].startswith("text/event-stream") and route == "/v1/responses":
            last = json.loads(r.text.strip().rsplit("\n", 1)[-1].removeprefix("data: "))
            assert last["type"] in ("response.completed", "response.incomplete", "response.failed"), r.text
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.endswith("data: [DONE]\n\n")


def test_the_router_stays_healthy_after_the_fuzzing(front: Front) -> None:
    assert httpx.get(f"{front.base}/health").json()["status"] == "ok"
    assert greedy(front, HELLO, 2)


# -- the README's own snippets


def test_the_readme_snippets_run_against_an_open_router(front: Front) -> None:
    # The README's snippets send no key (curl) or any key (the SDK): an open router, on the same replica.
    router = ServiceProcess("services.router", ["--replicas", front.replica.address, "--http-port", "0"])
    with router.start():
        base = http_base(router)
        curl = readme_block("bash", "/v1/chat/completions").replace(README_BASE, base)
        answered = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
        assert answered.returncode == 0, answered.stderr
        assert json.loads(answered.stdout)["choices"][0]["message"]["content"]
        sdk = readme_block("python", "from openai import OpenAI").replace(README_BASE, base)
        printed = subprocess.run([sys.executable, "-c", sdk], capture_output=True, text=True, timeout=120)
        assert printed.returncode == 0, printed.stderr
        assert printed.stdout.strip()


def test_sigterm_lets_an_open_stream_finish_then_the_router_exits(front: Front) -> None:
    router = ServiceProcess("services.router", ["--replicas", front.replica.address, "--http-port", "0"])
    router.start()
    try:
        base = http_base(router)
        body = {"model": front.model, "messages": HELLO, "max_tokens": 24, "ignore_eos": True, "stream": True}
        chunks: list[dict] = []
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    break
            router.signal(signal.SIGTERM)  # mid-answer
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{base}/health", timeout=5)  # no new connections while draining
            rest = list(lines)
        chunks += [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert [line for line in rest if line][-1] == "data: [DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert router.proc is not None and router.proc.wait(30) == 0
    finally:
        router.stop()


# -- embeddings, through the retriever's model


def test_embeddings_come_from_the_retrievers_model(front: Front, tmp_path: Path) -> None:
    import numpy as np
    from langchain_openai import OpenAIEmbeddings

    retriever = ServiceProcess("services.retriever", ["--milvus-uri", str(tmp_path / "milvus.db")]).start(240)
    router = ServiceProcess(
        "services.router",
        ["--replicas", front.replica.address, "--retriever-addr", retriever.address, "--http-port", "0"],
    )
    try:
        with router.start():
            v1 = f"{http_base(router)}/v1"
            client = openai.OpenAI(base_url=v1, api_key="unused-on-an-open-router", max_retries=0)
            texts = ["a cat sat on the mat", "a kitten sat on a rug", "quarterly tax filing deadlines"]
            got = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the SDK asks for base64
            assert [d.index for d in got.data] == [0, 1, 2]
            assert got.model == "sentence-transformers/all-MiniLM-L6-v2" and got.usage.prompt_tokens > 0
            vectors = [np.asarray(d.embedding) for d in got.data]
            assert all(v.shape == (384,) and abs(np.linalg.norm(v) - 1) < 1e-4 for v in vectors)
            assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]  # near in meaning, near in space
            floats = httpx.post(
                f"{v1}/embeddings", json={"input": texts[0], "encoding_format": "float"}
            ).json()
            assert np.allclose(floats["data"][0]["embedding"], vectors[0], atol=1e-6)
            langchain = OpenAIEmbeddings(
                base_url=v1,
                api_key="unused",
                model="all-MiniLM-L6-v2",
                check_embedding_ctx_length=False,  # type: ignore[arg-type]
            )
            assert np.allclose(langchain.embed_query(texts[0]), vectors[0], atol=1e-6)
            wrong_model = httpx.post(
                f"{v1}/embeddings", json={"input": "x", "model": "text-embedding-3-small"}
            )
            assert "all-MiniLM-L6-v2" in assert_error(wrong_model, 404, "model", "model_not_found")["message"]
            assert_error(
                httpx.post(f"{v1}/embeddings", json={"input": "x", "dimensions": 64}), 400, "dimensions"
            )
            # Longer than MiniLM's 256-token input: refused naming it, as OpenAI and vLLM refuse
            # it, not embedded from its first 256 tokens alone.
            long_text = " ".join(f"word{i}" for i in range(400))
            over = httpx.post(f"{v1}/embeddings", json={"input": ["short", long_text]})
            assert assert_error(over, 400, "input")["message"].startswith("input[1]: ")
            # The usage counts what the model read: each text's tokens and its [CLS] and [SEP].
            two_words = client.embeddings.create(model="all-MiniLM-L6-v2", input=["hello world"])
            assert two_words.usage.prompt_tokens == 4
            token_ids = assert_error(httpx.post(f"{v1}/embeddings", json={"input": [[1, 2]]}), 400, "input")
            # What LangChain's OpenAIEmbeddings sends by default: the message says how to stop it.
            assert "check_embedding_ctx_length=False" in token_ids["message"]
    finally:
        retriever.stop()


def test_embeddings_without_a_retriever_say_so(front: Front) -> None:
    error = assert_error(front.post("/v1/embeddings", {"input": "x"}), 400, code="failed_precondition")
    assert "--retriever-addr" in error["message"]
