"""Sampler: greedy, top-k/top-p masks, and draws keyed by (seed, token index) independent of the batch."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgument
from services.inference.sampler import Sampler, draw_key, sample_row
from services.inference.sampling import SamplingParams

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


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": -1.0}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.01}),
        ("max_tokens", {"max_tokens": 0}),
        ("top_k", {"top_k": -2}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("stop", {"stop": ("",)}),
    ],
)
def test_invalid_sampling_params_name_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument) as caught:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert caught.value.field == field
