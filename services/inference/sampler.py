"""Turns last-position logits into next tokens: greedy, temperature, top-k, top-p, repetition penalty.

Each random draw uses a generator keyed by (request seed, token index), so a
request's tokens do not depend on its batch neighbours, and a resumed or
recomputed request draws exactly what the original would have.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from services.inference.sampling import SamplingParams

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
    ) -> list[int]:
        """``logits`` is [N, vocab]; the other arguments give each row's request state."""
        simple = all(p.greedy and p.repetition_penalty == 1.0 for p in params)
        # max().indices is cheaper than argmax on CPU and picks the same (first) maximum.
        greedy_ids = logits.max(dim=-1).indices.tolist()
        if simple:
            return greedy_ids
        out: list[int] = []
        for i, p in enumerate(params):
            if p.greedy and p.repetition_penalty == 1.0:
                out.append(greedy_ids[i])
                continue
            row = logits[i].float()
            if p.repetition_penalty != 1.0:
                row = apply_repetition_penalty(row, histories[i], p.repetition_penalty)
            if p.greedy:
                out.append(int(row.argmax().item()))
            else:
                out.append(sample_row(row, p, draw_key(seeds[i], token_indices[i])))
        return out
