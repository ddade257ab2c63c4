"""Sampler: greedy, top-k/top-p masks, and draws keyed by (seed, token index) independent of the batch."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgument
from services.inference import sampler as sampler_module
from services.inference.sampler import (
    MAX_BLOCK,
    RowFault,
    Sampler,
    adjust_logits,
    draw_key,
    first_max,
    sample_row,
)
from services.inference.sampling import MIN_TEMPERATURE, SamplingParams

VOCAB = 50


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_same_seed_and_index_draw_the_same_token_whatever_the_batch() -> None:
    sampler = Sampler()
    hot = SamplingParams(temperature=1.5, seed=42)
    row = logits_rows(1, seed=3)
    alone = sampler(row, [hot], [42], [5], [[]])
    neighbours = logits_rows(6, seed=9)
    batch = torch.cat([neighbours[:3], row, neighbours[3:]])
    params = [SamplingParams(temperature=0.9, seed=i) for i in range(3)] + [hot]
    params += [SamplingParams(temperature=0.0)] * 3
    in_batch = sampler(batch, params, [0, 1, 2, 42, 0, 0, 0], [0, 1, 2, 5, 0, 0, 0], [[]] * 7)
    assert in_batch[3] == alone[0]


def test_draws_depend_on_the_token_index() -> None:
    row = logits_rows(1)[0] * 0.01  # nearly flat: different keys give different tokens
    p = SamplingParams(temperature=1.0, seed=7)
    tokens = {sample_row(row, p, draw_key(7, i)) for i in range(20)}
    assert len(tokens) > 5


def test_seeds_that_differ_only_in_bit_63_draw_differently_and_low_seeds_key_as_before() -> None:
    row = logits_rows(1)[0] * 0.01
    p = SamplingParams(temperature=1.0)
    low = [sample_row(row, p, draw_key(5, i)) for i in range(40)]
    high = [sample_row(row, p, draw_key(5 + 2**63, i)) for i in range(40)]
    assert low != high
    # The keys of seeds below 2**63 did not move: recorded seeded answers still reproduce.
    assert [draw_key(5, i) for i in range(3)] == [
        (5 ^ ((i + 1) * 0x9E3779B97F4A7C15)) & (2**63 - 1) for i in range(3)
    ]


def test_greedy_picks_the_argmax_per_row() -> None:
    rows = logits_rows(4)
    got = Sampler()(rows, [SamplingParams(temperature=0.0)] * 4, [0] * 4, [0] * 4, [[]] * 4)
    assert got == rows.argmax(dim=-1).tolist()


def test_top_k_one_is_greedy_and_top_p_tiny_keeps_only_the_top_token() -> None:
    row = logits_rows(1, seed=5)[0]
    best = int(row.argmax())
    for i in range(10):
        assert sample_row(row, SamplingParams(temperature=2.0, top_k=1), draw_key(1, i)) == best
        assert sample_row(row, SamplingParams(temperature=2.0, top_p=1e-6), draw_key(1, i)) == best


def test_repetition_penalty_steers_greedy_away_from_seen_tokens() -> None:
    row = torch.zeros(1, VOCAB)
    row[0, 3] = 2.0
    row[0, 4] = 1.5
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler()(row, [params], [0], [0], [[3]]) == [4]


def test_presence_and_frequency_penalties_count_only_the_output() -> None:
    # Prompt [7, 7, 7], output [3, 3, 4]: the prompt's 7 is not penalised; 3 twice, 4 once.
    row = torch.zeros(VOCAB)
    history = [7, 7, 7, 3, 3, 4]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = adjust_logits(row, params, history, num_output=3)
    expected = torch.zeros(VOCAB)
    expected[3] = -(0.5 + 2 * 0.25)
    expected[4] = -(0.5 + 0.25)
    assert torch.equal(got, expected)
    assert torch.equal(row, torch.zeros(VOCAB)), "the caller's logits are not written"
    # A negative penalty encourages repeating; nothing in the output yet: nothing moves.
    assert float(adjust_logits(row, SamplingParams(presence_penalty=-1.0), history, 3)[4]) == 1.0
    assert torch.equal(adjust_logits(row, params, history, num_output=0), row)


def test_a_penalty_steers_greedy_to_a_token_not_yet_written() -> None:
    row = torch.zeros(1, VOCAB)
    row[0, 3] = 2.0
    row[0, 4] = 1.5
    free = SamplingParams(temperature=0.0)
    penalised = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    # Written once: 2.0 - 0.3 still beats 1.5; twice: 1.4 does not.
    assert Sampler()(row.repeat(2, 1), [free, penalised], [0, 0], [1, 1], [[3], [3]]) == [3, 3]
    assert Sampler()(row, [penalised], [0], [2], [[3, 3]]) == [4]
    # In the prompt only (num_output 0): no penalty.
    assert Sampler()(row, [penalised], [0], [0], [[3, 3]]) == [3]


def test_logit_bias_bans_and_forces_tokens_in_greedy_and_sampled_rows() -> None:
    rows = logits_rows(3, seed=8)
    best = rows.argmax(dim=-1).tolist()
    ban = SamplingParams(temperature=0.0, logit_bias=((best[0], -100.0),))
    force = SamplingParams(temperature=1.0, seed=1, logit_bias=((11, 100.0),))
    free = SamplingParams(temperature=0.0)
    got = Sampler()(rows, [ban, force, free], [0, 1, 0], [0, 0, 0], [[], [], []])
    second = int(rows[0].topk(2).indices[1])
    assert got == [second, 11, best[2]]


def test_min_tokens_holds_back_the_end_tokens_until_enough_are_written() -> None:
    row = torch.zeros(1, VOCAB)
    row[0, 2] = 5.0  # the end token, by far the likeliest
    row[0, 6] = 1.0
    sampler = Sampler(end_ids=(2,))
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3)
    assert [sampler(row, [params], [0], [i], [[]]) for i in range(4)] == [[6], [6], [6], [2]]
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=8, min_tokens=3)
    assert all(sampler(row, [sampled], [3], [i], [[]]) != [2] for i in range(3))
    # ignore_eos makes min_tokens moot: nothing is held back.
    moot = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, ignore_eos=True)
    assert sampler(row, [moot], [0], [0], [[]]) == [2]
    # Stop token ids are held back too, also with ignore_eos (it is about the model's end only).
    stop_held = SamplingParams(
        temperature=0.0, max_tokens=8, min_tokens=1, ignore_eos=True, stop_token_ids=(6,)
    )
    row[0, 4] = 0.5
    assert sampler(row, [stop_held], [0], [0], [[]]) == [2]
    assert sampler(row, [stop_held], [0], [1], [[]]) == [2]
    stop_and_end = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=1, stop_token_ids=(6,))
    assert sampler(row, [stop_and_end], [0], [0], [[]]) == [4]
    # A constraint that allows only the end here still ends: there is nothing else to draw.
    only_end = torch.full((1, VOCAB), float("-inf"))
    only_end[0, 2] = 0.0
    assert sampler(only_end, [params], [0], [0], [[]]) == [2]


def test_min_p_drops_tokens_below_its_share_of_the_likeliest() -> None:
    # Probabilities ∝ 8, 4, 2, 1, 1 (after temperature 1): min_p 0.3 keeps 8 and 4 only.
    row = torch.full((VOCAB,), float("-inf"))
    row[[10, 11, 12, 13, 14]] = torch.log(torch.tensor([8.0, 4.0, 2.0, 1.0, 1.0]))
    params = SamplingParams(temperature=1.0, min_p=0.3)
    assert {sample_row(row, params, draw_key(9, i)) for i in range(200)} == {10, 11}
    # 1 keeps only the likeliest (greedy whatever the temperature); 0 is off.
    assert {
        sample_row(row, SamplingParams(temperature=3.0, min_p=1.0), draw_key(9, i)) for i in range(50)
    } == {10}
    assert {sample_row(row, SamplingParams(temperature=1.0), draw_key(9, i)) for i in range(400)} == set(
        range(10, 15)
    )


def test_only_allowed_tokens_are_drawn_and_a_mask_leaving_none_is_the_requests_fault() -> None:
    rows = logits_rows(2, seed=12)
    allowed = (3, 17, 40)
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    hot = SamplingParams(temperature=2.0, seed=4, allowed_token_ids=allowed)
    best = max(allowed, key=lambda t: float(rows[0, t]))
    assert Sampler()(rows[:1], [greedy], [0], [0], [[]]) == [best]
    drawn = {Sampler()(rows[1:], [hot], [4], [i], [[]])[0] for i in range(60)}
    assert drawn == set(allowed)
    # A constraint's mask that forbids every allowed token: that request alone, named.
    masked = rows.clone()
    masked[0, list(allowed)] = float("-inf")
    got = Sampler()(masked, [greedy, SamplingParams(temperature=0.0)], [0, 0], [0, 0], [[], []])
    assert isinstance(got[0], RowFault) and got[0].invalid_field == "allowed_token_ids"
    assert got[1] == int(masked[1].argmax())


def test_a_bad_words_last_token_is_banned_only_where_the_output_ends_with_the_rest() -> None:
    row = torch.zeros(1, VOCAB)
    row[0, 7] = 3.0  # the likeliest: the end of the two-token word (5, 7)
    row[0, 9] = 2.0  # a one-token word: never drawn
    row[0, 1] = 1.0
    params = SamplingParams(temperature=0.0, bad_word_ids=((5, 7), (9,)))
    # Output [.., 5]: 7 would complete the word; history's prompt part does not count.
    assert Sampler()(row, [params], [0], [1], [[2, 5]]) == [1]
    assert Sampler()(row, [params], [0], [1], [[5, 2]]) == [7]
    assert Sampler()(row, [params], [0], [0], [[5]]) == [7]  # the 5 is the prompt's
    # A constraint that allows only a banned token: that request alone, named.
    masked = torch.full((1, VOCAB), float("-inf"))
    masked[0, 9] = 0.0
    (fault,) = Sampler()(masked, [params], [0], [0], [[]])
    assert isinstance(fault, RowFault) and fault.invalid_field == "bad_words"


def test_logprobs_are_those_of_the_adjusted_distribution() -> None:
    row = logits_rows(1, seed=6)
    params = SamplingParams(
        temperature=0.0, logprobs=True, top_logprobs=2, frequency_penalty=1.0, logit_bias=((5, 3.0),)
    )
    (drawn,) = Sampler()(row, [params], [0], [1], [[9]])
    expected = row[0].clone()
    expected[5] += 3.0
    expected[9] -= 1.0
    reference = torch.log_softmax(expected, dim=-1)
    assert not isinstance(drawn, (int, RowFault))
    assert drawn.token == int(expected.argmax())
    assert drawn.logprob == pytest.approx(float(reference[drawn.token]), abs=1e-6)
    assert [t for t, _ in drawn.top] == reference.topk(2).indices.tolist()


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("min_tokens", {"min_tokens": 9, "max_tokens": 8}),
        ("min_tokens", {"min_tokens": -1}),
        ("stop_token_ids", {"stop_token_ids": (-1,)}),
        ("min_p", {"min_p": 1.5}),
        ("allowed_token_ids", {"allowed_token_ids": (-4,)}),
        ("bad_words", {"bad_words": (" ",)}),
        ("bad_words", {"bad_words": ("x" * 513,)}),
        ("bad_words", {"bad_words": ("w",) * 65}),
        ("allowed_token_ids", {"allowed_token_ids": tuple(range(16_385))}),
        ("min_p", {"min_p": float("nan")}),
        ("stop_token_ids", {"stop_token_ids": tuple(range(65))}),
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("presence_penalty", {"presence_penalty": float("nan")}),
        ("frequency_penalty", {"frequency_penalty": -2.01}),
        ("frequency_penalty", {"frequency_penalty": float("-inf")}),
        ("logit_bias", {"logit_bias": ((1, 100.5),)}),
        ("logit_bias", {"logit_bias": ((1, float("nan")),)}),
        ("logit_bias", {"logit_bias": ((-1, 1.0),)}),
        ("logit_bias", {"logit_bias": tuple((i, 1.0) for i in range(301))}),
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": -1.0}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.01}),
        ("max_tokens", {"max_tokens": 0}),
        ("top_k", {"top_k": -2}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("repetition_penalty", {"repetition_penalty": 1.4e-45}),
        ("repetition_penalty", {"repetition_penalty": 1e30}),
        ("repetition_penalty", {"repetition_penalty": float("nan")}),
        ("repetition_penalty", {"repetition_penalty": float("inf")}),
        ("stop", {"stop": ("",)}),
    ],
)
def test_invalid_sampling_params_name_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument) as caught:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_temperatures_below_the_floor_sample_as_greedy() -> None:
    rows = logits_rows(3, seed=11) * 30  # large logits: x / 1e-40 overflows float32 to inf
    for temperature in (1e-40, 1e-30, MIN_TEMPERATURE / 2):
        params = SamplingParams(temperature=temperature, seed=3)
        assert params.greedy
        got = Sampler()(rows, [params] * 3, [3] * 3, [0] * 3, [[]] * 3)
        assert got == rows.argmax(dim=-1).tolist()
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy


def test_penalties_at_the_bounds_keep_the_distribution_finite() -> None:
    row = logits_rows(1, seed=2) * 80
    history = [[t for t in range(VOCAB) if t % 3]]  # most tokens seen
    for penalty in (0.01, 100.0):
        for temperature in (0.0, MIN_TEMPERATURE, 0.7, 3.4e38):
            params = SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=1)
            (token,) = Sampler()(row, [params], [1], [0], history)
            assert isinstance(token, int) and 0 <= token < VOCAB


def test_a_row_with_non_finite_logits_fails_alone() -> None:
    rows = logits_rows(4, seed=4)
    rows[1, 7] = float("nan")
    rows[2, 9] = float("inf")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    params += [SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=0.8, seed=6)]
    got = Sampler()(rows, params, [0, 0, 5, 6], [0, 0, 2, 2], [[]] * 4)
    assert isinstance(got[1], RowFault) and "non-finite" in got[1].reason
    assert isinstance(got[2], RowFault)
    assert got[0] == int(rows[0].argmax())
    assert got[3] == sample_row(rows[3], params[3], draw_key(6, 2))


def test_an_exception_in_one_rows_draw_fails_that_row_only(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = logits_rows(3, seed=8)
    params = [SamplingParams(temperature=0.9, seed=s) for s in (1, 2, 3)]
    expected = [sample_row(rows[i], params[i], draw_key(i + 1, 0)) for i in range(3)]
    real = sampler_module.sample_row

    def flaky(row: torch.Tensor, p: SamplingParams, key: int) -> int:
        if p.seed == 2:
            raise RuntimeError("boom")
        return real(row, p, key)

    monkeypatch.setattr(sampler_module, "sample_row", flaky)
    got = Sampler()(rows, params, [1, 2, 3], [0, 0, 0], [[]] * 3)
    assert got[0] == expected[0] and got[2] == expected[2]
    assert isinstance(got[1], RowFault) and "boom" in got[1].reason and not got[1].forward_failed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, MAX_BLOCK, 3 * MAX_BLOCK, 3 * MAX_BLOCK + 5, 49_152])
def test_first_max_is_max_with_the_first_index_on_ties_and_non_finite_rows(
    dtype: torch.dtype, vocab: int
) -> None:
    # Few distinct values: most rows tie across blocks, inside a block, and with the vocabulary's
    # tail; greedy must still pick the first maximum, the token argmax (and transformers) picks.
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-2, 3, (9, vocab), generator=g).to(dtype)
    logits[1] = -5.0
    logits[1, [vocab // 2, vocab - 1]] = 4.0  # an early and a last-position tie
    logits[2, vocab - 1] = 9.0  # the maximum in the last position alone
    logits[3, vocab // 3] = float("nan")
    logits[4, 0] = float("inf")
    logits[5, vocab - 1] = float("nan")  # a NaN in the tail past the last whole block
    values, indices = first_max(logits)
    expected = logits.max(dim=-1)
    finite = torch.isfinite(expected.values)
    assert torch.equal(torch.isfinite(values), finite)  # NaN and +inf rows are still caught
    assert finite.tolist() == [True, True, True, False, False, False, True, True, True]
    assert torch.equal(indices[finite], expected.indices[finite])
    assert torch.equal(values[finite], expected.values[finite])
    assert indices[1] == vocab // 2 and indices[2] == vocab - 1
