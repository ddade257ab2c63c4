"""OpenAI's presence and frequency penalties and logit bias, and vLLM's min_tokens, on the real model.

fp32 greedy decoding, step by step against transformers' own forward with the adjustment
applied here by hand (not by the engine's code): each step's token is the argmax of the
reference logits minus ``frequency × count + presence`` for the tokens the answer already
holds, plus the bias. The prompt invites repetition, so a penalty that was ignored (or
counted the prompt) would give other tokens. A request resumed part-way (what failover sends)
continues with exactly the tokens the whole request wrote.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common import errors
from services.inference.engine import LLMEngine, RequestOutput
from services.inference.sampling import Constraint, ConstraintKind, SamplingParams
from services.inference.sequence import FinishReason
from tests.support.device import fp32_engine, reference_model

PROMPT = "Repeat after me: the cat, the cat, the cat, the cat, the cat,"
STEPS = 16


@pytest.fixture(scope="module")
def engine(model_path: Path) -> LLMEngine:
    return fp32_engine(model_path)


@pytest.fixture(scope="module")
def model(model_path: Path) -> Any:
    return reference_model(model_path)


def run(
    engine: LLMEngine, ids: list[int], params: SamplingParams, resume: list[int] | None = None
) -> list[RequestOutput]:
    """One request to its end: every output it gave."""
    engine.add_request("r", ids, params, resume or ())
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def generate(
    engine: LLMEngine, ids: list[int], params: SamplingParams, resume: list[int] | None = None
) -> list[int]:
    """One request's tokens; it must not fail."""
    outputs = run(engine, ids, params, resume)
    assert not any(out.error for out in outputs), [out.error for out in outputs]
    return [t for out in outputs for t in out.new_token_ids]


def greedy_reference(
    model: Any,
    ids: list[int],
    adjust: Callable[[torch.Tensor, list[int]], None],
    steps: int = STEPS,
    end_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """transformers' greedy tokens (its own forward and KV cache), each step's logits first moved
    in place by ``adjust(logits, output so far)``; ends after ``steps`` tokens or an end token."""
    output: list[int] = []
    inputs, past = torch.tensor([ids], device=model.device), None
    while len(output) < steps and not (output and output[-1] in end_ids):
        with torch.inference_mode():
            out = model(inputs, cache=past, use_cache=True)
        past = out.cache
        logits = out.logits[0, -1].float().cpu().clone()  # a normal tensor: written outside inference mode
        adjust(logits, output)
        output.append(int(logits.argmax()))
        inputs = torch.tensor([[output[-1]]], device=model.device)
    return output


def reference(
    model: Any, ids: list[int], presence: float, frequency: float, bias: dict[int, float]
) -> list[int]:
    """Greedy tokens of transformers' forward with OpenAI's adjustment written out here."""

    def adjust(logits: torch.Tensor, output: list[int]) -> None:
        for token, value in bias.items():
            logits[token] += value
        for token, count in Counter(output).items():
            logits[token] -= frequency * count + presence

    return greedy_reference(model, ids, adjust)


@pytest.mark.parametrize(
    ("presence", "frequency"), [(0.0, 0.0), (1.5, 0.0), (0.0, 0.8), (0.6, 0.6), (-1.0, 0.0)]
)
def test_greedy_tokens_with_penalties_equal_transformers_adjusted_by_hand(
    engine: LLMEngine, model: Any, presence: float, frequency: float
) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(
        max_tokens=STEPS,
        temperature=0.0,
        ignore_eos=True,
        presence_penalty=presence,
        frequency_penalty=frequency,
    )
    expected = reference(model, ids, presence, frequency, {})
    assert generate(engine, ids, params) == expected
    if presence > 0 or frequency > 0:
        # The prompt makes the free answer repeat: a working penalty must change it.
        assert expected != reference(model, ids, 0.0, 0.0, {})


def test_logit_bias_bans_the_free_answers_tokens_and_forces_a_chosen_one(
    engine: LLMEngine, model: Any
) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    free = reference(model, ids, 0.0, 0.0, {})
    banned = {token: -100.0 for token in set(free[:4])}
    params = SamplingParams(
        max_tokens=STEPS, temperature=0.0, ignore_eos=True, logit_bias=tuple(sorted(banned.items()))
    )
    got = generate(engine, ids, params)
    assert got == reference(model, ids, 0.0, 0.0, banned)
    assert not set(got) & set(banned)
    forced = engine.tokenizer.encode(" zebra")[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias=((forced, 100.0),))
    assert generate(engine, ids, params) == [forced] * 4


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_resumed_request_is_penalised_as_the_original_was(engine: LLMEngine, temperature: float) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(
        max_tokens=STEPS,
        temperature=temperature,
        seed=5,
        ignore_eos=True,
        frequency_penalty=0.7,
        presence_penalty=0.3,
    )
    whole = generate(engine, ids, params)
    resumed = generate(engine, ids, params, resume=whole[:6])
    assert whole[:6] + resumed == whole


def test_min_tokens_writes_past_the_models_end_as_transformers_does_with_the_end_held_back(
    engine: LLMEngine, model: Any
) -> None:
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
    end_ids = set(engine.runner.sampler.end_ids)
    free = generate(engine, ids, SamplingParams(max_tokens=40, temperature=0.0))
    assert free[-1] in end_ids and len(free) < 30, "the free answer must end on its own"
    least = len(free) + 4
    held = generate(engine, ids, SamplingParams(max_tokens=40, temperature=0.0, min_tokens=least))

    # transformers' greedy tokens with the end tokens masked while fewer than `least` are out.
    def hold_end(logits: torch.Tensor, output: list[int]) -> None:
        if len(output) < least:
            logits[sorted(end_ids)] = float("-inf")

    assert held == greedy_reference(model, ids, hold_end, steps=40, end_ids=frozenset(end_ids))
    assert len(held) > least and not set(held[:least]) & end_ids


def test_min_p_one_keeps_only_the_likeliest_token_so_a_hot_draw_is_greedy(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    greedy = generate(engine, ids, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    hot = SamplingParams(max_tokens=STEPS, temperature=1.8, seed=11, ignore_eos=True)
    assert generate(engine, ids, hot) != greedy, (
        "a hot draw must differ from greedy for this to test anything"
    )
    kept = SamplingParams(max_tokens=STEPS, temperature=1.8, seed=11, ignore_eos=True, min_p=1.0)
    assert generate(engine, ids, kept) == greedy


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_stop_token_ends_the_answer_without_its_text_also_with_ignore_eos(
    engine: LLMEngine, ignore_eos: bool
) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    free = generate(engine, ids, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    stop = free[5]
    first = free.index(stop)  # where it first appears
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=ignore_eos, stop_token_ids=(stop,))
    outputs = run(engine, ids, params)
    assert [t for o in outputs for t in o.new_token_ids] == free[: first + 1]
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert "".join(o.text for o in outputs) == engine.tokenizer.decode(free[:first])
    # Asked to keep it, the stop token's text ends the answer.
    kept = dataclasses.replace(params, include_stop_str_in_output=True)
    outputs = run(engine, ids, kept)
    assert "".join(o.text for o in outputs) == engine.tokenizer.decode(free[: first + 1])
    # min_tokens holds a stop token back as it does the end of sequence.
    held = generate(
        engine,
        ids,
        SamplingParams(max_tokens=STEPS, temperature=0.0, stop_token_ids=(stop,), min_tokens=first + 2),
    )
    assert stop not in held[: first + 2] and len(held) > first + 2


def test_allowed_token_ids_confine_the_greedy_answer_as_a_hand_mask_on_transformers_does(
    engine: LLMEngine, model: Any
) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    free = reference(model, ids, 0.0, 0.0, {})
    # The free answer's tokens but its first, plus two others: the answer must find another way.
    allowed = sorted((set(free) | set(engine.tokenizer.encode(" dog sat"))) - {free[0]})
    assert free[0] not in allowed

    def only_allowed(logits: torch.Tensor, output: list[int]) -> None:
        keep = logits[allowed].clone()
        logits.fill_(float("-inf"))
        logits[allowed] = keep

    params = SamplingParams(
        max_tokens=STEPS, temperature=0.0, ignore_eos=True, allowed_token_ids=tuple(allowed)
    )
    got = generate(engine, ids, params)
    assert got == greedy_reference(model, ids, only_allowed)
    assert set(got) <= set(allowed)


def test_allowed_token_ids_a_constraint_forbids_end_the_request_as_its_own_invalid_argument(
    engine: LLMEngine,
) -> None:
    words = engine.tokenizer.encode(" dog cat")  # what a digits-only regex cannot begin with
    params = SamplingParams(
        max_tokens=4,
        temperature=0.0,
        constraint=Constraint(ConstraintKind.REGEX, "[0-9]+"),
        allowed_token_ids=tuple(words),
    )
    outputs = run(engine, engine.tokenizer.encode(PROMPT), params)
    assert outputs[-1].invalid_field == "allowed_token_ids" and outputs[-1].finished
    assert "allows none" in outputs[-1].error


def test_allowed_token_ids_of_only_end_tokens_with_min_tokens_are_refused_naming_min_tokens(
    engine: LLMEngine,
) -> None:
    """min_tokens holds end tokens back, so nothing could be drawn: the answer ended at once with
    STOP, min_tokens silently dropped."""
    eos = engine.tokenizer.eos_token_id
    params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=5, allowed_token_ids=(eos,))
    with pytest.raises(errors.InvalidArgument, match=r"^min_tokens: allowed_token_ids hold only end tokens"):
        engine.validate(engine.tokenizer.encode(PROMPT), params)
    # With a token that is no end among them, min_tokens has something to draw.
    word = engine.tokenizer.encode(" dog", add_special_tokens=False)[0]
    engine.validate(
        engine.tokenizer.encode(PROMPT), dataclasses.replace(params, allowed_token_ids=(eos, word))
    )


def test_bad_words_keep_a_word_out_of_the_answer_as_a_hand_ban_on_transformers_does(
    engine: LLMEngine, model: Any
) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    free = reference(model, ids, 0.0, 0.0, {})
    assert "cat" in engine.tokenizer.decode(free), "the free answer must write the word"
    words = {tuple(engine.tokenizer.encode(w, add_special_tokens=False)) for w in ("cat", " cat")}

    def ban(logits: torch.Tensor, output: list[int]) -> None:
        for word in words:
            if len(word) == 1 or output[len(output) - len(word) + 1 :] == list(word[:-1]):
                logits[word[-1]] = float("-inf")

    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, bad_words=("cat",))
    got = generate(engine, ids, params)
    assert got == greedy_reference(model, ids, ban)
    assert "cat" not in engine.tokenizer.decode(got)


def test_a_logit_bias_id_outside_the_vocabulary_is_refused_naming_the_field(engine: LLMEngine) -> None:
    vocab = engine.runner.vocab_size
    params = SamplingParams(max_tokens=2, logit_bias=((vocab, 5.0),))
    with pytest.raises(errors.InvalidArgument) as caught:
        engine.add_request("bad", engine.tokenizer.encode(PROMPT), params)
    assert caught.value.field == "logit_bias" and str(vocab) in str(caught.value)
    params = SamplingParams(max_tokens=2, stop_token_ids=(2, vocab + 7))
    with pytest.raises(errors.InvalidArgument) as caught:
        engine.add_request("bad", engine.tokenizer.encode(PROMPT), params)
    assert caught.value.field == "stop_token_ids" and str(vocab + 7) in str(caught.value)
    assert not engine.has_unfinished_requests()
