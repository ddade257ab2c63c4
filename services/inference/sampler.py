"""Turns last-position logits into next tokens: greedy, temperature, top-k, top-p, repetition penalty.

Each random draw uses a generator keyed by (request seed, token index), so a
request's tokens do not depend on its batch neighbours, and a resumed or
recomputed request draws exactly what the original would have.

Each row is drawn on its own: a row whose logits are not finite, whose
probabilities are not a distribution, or whose draw raises becomes a ``RowFault``
for its request alone, and the other rows of the step keep their tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from services.inference.sampling import SamplingParams

log = logging.getLogger("llmmesh.inference.sampler")


@dataclass(frozen=True)
class RowFault:
    """Why no token could be drawn for one row; its request fails, no other."""

    reason: str
    #: The forward itself failed on the row: the K/V it wrote this step cannot be trusted.
    forward_failed: bool = False


_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


def draw_key(seed: int, token_index: int) -> int:
    """The generator seed for token ``token_index`` of a request seeded with ``seed``."""
    return (seed ^ ((token_index + 1) * _GOLDEN)) & _MASK63


def apply_repetition_penalty(row: torch.Tensor, seen: Seq[int], penalty: float) -> torch.Tensor:
    """CTRL-style penalty: shrink logits of tokens already seen (divide positives, multiply negatives)."""
    ids = torch.tensor(sorted(set(seen)), dtype=torch.long, device=row.device)
    picked = row.index_select(0, ids)
    row = row.clone()
    row[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return row


def sample_row(row: torch.Tensor, params: SamplingParams, key: int) -> int:
    """Draw one token from a float32 logits row with temperature, top-k and top-p."""
    row = row / params.temperature
    if 0 < params.top_k < row.shape[-1]:
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        row = row.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(row, dim=-1).cpu()
    # multinomial would raise on NaN or inf (and a generator-keyed draw from garbage is worse).
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        raise ValueError("the sampling probabilities are not finite")
    generator = torch.Generator().manual_seed(key)
    return int(torch.multinomial(probs, 1, generator=generator).item())


class Sampler:
    """Picks one token per row of logits."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Seq[SamplingParams],
        seeds: Seq[int],
        token_indices: Seq[int],
        histories: Seq[Seq[int]],
    ) -> Seq[int | RowFault]:
        """``logits`` is [N, vocab]; the other arguments give each row's request state.

        One token per row, or a ``RowFault`` for a row that could not be drawn.
        """
        # max() is cheaper than argmax on CPU and picks the same (first) maximum. Its values
        # check every row for free: a NaN or +inf anywhere in a row makes that row's max so.
        best = logits.max(dim=-1)
        greedy_ids = best.indices.tolist()
        finite = bool(torch.isfinite(best.values).all())
        if finite and all(p.greedy and p.repetition_penalty == 1.0 for p in params):
            return greedy_ids
        row_finite = torch.isfinite(best.values).tolist() if not finite else None
        out: list[int | RowFault] = []
        for i, p in enumerate(params):
            if row_finite is not None and not row_finite[i]:
                out.append(RowFault("the model produced non-finite logits for this request"))
                continue
            if p.greedy and p.repetition_penalty == 1.0:
                out.append(greedy_ids[i])
                continue
            try:
                out.append(self._draw(logits[i], p, seeds[i], token_indices[i], histories[i]))
            except Exception as exc:  # this row's alone: the step's other rows keep their tokens
                log.exception(
                    "sampling failed for one row (token %d); only its request fails", token_indices[i]
                )
                out.append(RowFault(f"sampling failed: {exc}"))
        return out

    @staticmethod
    def _draw(logits: torch.Tensor, p: SamplingParams, seed: int, token_index: int, history: Seq[int]) -> int:
        row = logits.float()
        if p.repetition_penalty != 1.0:
            row = apply_repetition_penalty(row, history, p.repetition_penalty)
        if p.greedy:
            return int(row.argmax().item())
        return sample_row(row, p, draw_key(seed, token_index))
