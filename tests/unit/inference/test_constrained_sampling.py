"""The sampler's constraint mask and logprobs, with a stand-in guide (no model): only constrained
rows are masked, draws respect the mask, logprobs are the masked row's log_softmax."""

from __future__ import annotations

import ctypes

import pytest
import torch

from services.common.errors import InvalidArgument
from services.inference.outputs import SampledToken
from services.inference.sampler import RowFault, Sampler
from services.inference.sampling import Constraint, ConstraintKind, SamplingParams

VOCAB = 100


class AllowOnly:
    """A guide that allows exactly ``allowed`` token ids (as llguidance fills a bitmask row)."""

    def __init__(self, *allowed: int, error: str = "") -> None:
        self.allowed = allowed
        self.error = error
        self.field = "regex"

    def fill(self, ptr: int, nbytes: int) -> None:
        ctypes.memset(ptr, 0, nbytes)
        words = (ctypes.c_uint32 * (nbytes // 4)).from_address(ptr)
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)


def rows(n: int) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(1))


def test_only_constrained_rows_are_masked_and_greedy_takes_the_best_allowed_token() -> None:
    logits = rows(3)
    before = logits.clone()
    greedy = SamplingParams(temperature=0.0)
    allowed = (5, 37, 64)
    out = Sampler()(logits, [greedy] * 3, [0] * 3, [0] * 3, [[]] * 3, [None, AllowOnly(*allowed), None])  # type: ignore[list-item]
    assert out[0] == int(before[0].argmax()) and out[2] == int(before[2].argmax())
    assert out[1] == max(allowed, key=lambda t: float(before[1, t]))
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isfinite(logits[1]).sum() == len(allowed)


def test_sampled_rows_never_draw_a_forbidden_token() -> None:
    hot = SamplingParams(temperature=1.5, seed=3)
    for index in range(30):
        out = Sampler()(rows(1), [hot], [3], [index], [[]], [AllowOnly(7, 8)])  # type: ignore[list-item]
        assert out[0] in (7, 8)


def test_logprobs_are_the_masked_rows_log_softmax_with_the_true_top_k() -> None:
    logits = rows(2)
    raw = logits.clone()
    params = [
        SamplingParams(temperature=0.0, top_logprobs=3),
        SamplingParams(temperature=0.0, top_logprobs=6),
    ]
    out = Sampler()(logits, params, [0, 0], [0, 0], [[], []], [None, AllowOnly(1, 2, 3, 4)])  # type: ignore[list-item]
    free, constrained = out
    assert isinstance(free, SampledToken) and isinstance(constrained, SampledToken)
    expected = torch.log_softmax(raw[0], -1)
    assert free.logprob == pytest.approx(float(expected[free.token]), abs=1e-6)
    values, ids = torch.topk(expected, 3)
    assert [t for t, _ in free.top] == ids.tolist()
    assert [lp for _, lp in free.top] == pytest.approx(values.tolist(), abs=1e-6)
    masked = torch.log_softmax(raw[1, 1:5], -1)  # the four allowed tokens share all the mass
    assert constrained.logprob == pytest.approx(float(masked.max()), abs=1e-6)
    # Four tokens allowed: only they are alternatives, however many were asked for.
    assert sorted(t for t, _ in constrained.top) == [1, 2, 3, 4]


def test_a_row_whose_grammar_failed_ends_that_row_alone_naming_its_constraint() -> None:
    greedy = SamplingParams(temperature=0.0)
    out = Sampler()(rows(2), [greedy] * 2, [0, 0], [0, 0], [[], []], [AllowOnly(error="boom"), None])  # type: ignore[list-item]
    assert isinstance(out[0], RowFault) and "boom" in out[0].reason
    # The request's own input, not the engine: INVALID_ARGUMENT naming the field, no fault.
    assert out[0].invalid_field == "regex" and not out[0].forward_failed
    assert isinstance(out[1], int)


@pytest.mark.parametrize(
    ("field", "build"),
    [
        ("regex", lambda: Constraint(ConstraintKind.REGEX, "  ")),
        ("json_schema", lambda: Constraint(ConstraintKind.JSON_SCHEMA, "")),
        ("choice", lambda: Constraint(ConstraintKind.CHOICE, choices=())),
        ("choice", lambda: Constraint(ConstraintKind.CHOICE, choices=("a", ""))),
        ("top_logprobs", lambda: SamplingParams(top_logprobs=21)),
        ("top_logprobs", lambda: SamplingParams(top_logprobs=-1)),
    ],
)
def test_constraint_and_logprob_shapes_are_refused_naming_the_field(field: str, build: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        build()  # type: ignore[operator]
    assert caught.value.field == field
