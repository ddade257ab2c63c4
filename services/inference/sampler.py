"""Turns last-position logits into next tokens: greedy, temperature, min-p, top-k, top-p, logit bias and
the repetition, presence and frequency penalties.

Each random draw uses a generator keyed by (request seed, token index), so a
request's tokens do not depend on its batch neighbours, and a resumed or
recomputed request draws exactly what the original would have.

Each row is drawn on its own: a row whose logits are not finite, whose
probabilities are not a distribution, or whose draw raises becomes a ``RowFault``
for its request alone, and the other rows of the step keep their tokens.

A constrained row (its request has a ``Guide``, grammar.py) first gets its grammar's
token bitmask applied to its logits in place: what the grammar forbids is -inf before
any penalty, temperature or draw, so the greedy fast path stays exact. Rows without a
guide are not touched, and a step with no guide at all does no mask work.

Log probabilities, for the rows that ask only, are ``log_softmax`` of the logits the
draw used after the logit bias, the penalties and the grammar's mask, before temperature,
top-k and top-p (so greedy requests get the model's own distribution, and a
constrained token's alternatives are the ones the grammar allowed).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from services.inference.grammar import Guide
from services.inference.outputs import SampledToken
from services.inference.sampling import SamplingParams

log = logging.getLogger("llmmesh.inference.sampler")


@dataclass(frozen=True)
class RowFault:
    """Why no token could be drawn for one row; its request fails, no other."""

    reason: str
    #: The forward itself failed on the row: the K/V it wrote this step cannot be trusted.
    forward_failed: bool = False
    #: The request's own input cannot go on (its output constraint needs bytes no token of this
    #: vocabulary writes): the field to name. It ends as INVALID_ARGUMENT, not as an engine fault
    #: (INTERNAL): nothing went wrong in the engine, and any replica would end it the same way.
    invalid_field: str = ""


class NothingAllowed(ValueError):
    """A row's ``allowed_token_ids`` or ``bad_words`` and its output constraint leave no token:
    the request's own input cannot go on (INVALID_ARGUMENT on ``field``), not an engine fault."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field


#: One row's result: the token, the token with its logprobs, or why it could not be drawn.
RowResult = int | SampledToken | RowFault

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1
# Folded in for a seed's bit 63, which the 63-bit key cannot hold: seeds s and s + 2**63 drew
# alike (an OpenAI client's seed -1 is 2**64 - 1 here). A seed below 2**63 keys as it always did.
_HIGH_BIT_SALT = 0xD1B54A32D192ED03


#: Vocabulary positions per block of ``first_max``: fastest of 256–4,096 on a 49,152-token
#: vocabulary (bf16 and fp32, 1–256 rows; 2026-12-05).
MAX_BLOCK = 1024


def first_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum and the index of its first occurrence: ``logits.max(dim=-1)``, faster on CPU.

    PyTorch's CPU max-with-index walks the row one element at a time (2.4 ms for 64 rows of a
    49,152-token vocabulary in bf16, 5 % of a decode step), while a max without index is
    vectorised (0.5 ms). So each block of ``MAX_BLOCK`` positions is reduced without index,
    the first block holding the row's maximum is picked, and only that block is searched for
    its first maximum: the index ``max`` would give, ties included (an earlier block with an
    equal value would itself have been picked). A NaN or +inf anywhere in a row still makes
    that row's value so. Measured 2026-12-05: 64 rows 0.95 vs 2.4 ms in bf16, 0.56 vs 2.8 in fp32.
    """
    n, vocab = logits.shape
    whole = vocab // MAX_BLOCK * MAX_BLOCK
    if logits.device.type != "cpu" or whole == 0 or n == 0:
        # One kernel on a GPU beats five launches; a short row has nothing to block.
        best = logits.max(dim=-1)
        return best.values, best.indices
    logits = logits.contiguous()
    blocks = logits[:, :whole].view(n, whole // MAX_BLOCK, MAX_BLOCK)
    best_block = blocks.amax(dim=-1).max(dim=-1)
    inner = blocks[torch.arange(n), best_block.indices].max(dim=-1)
    values, indices = inner.values, best_block.indices * MAX_BLOCK + inner.indices
    if whole < vocab:
        # The tail wins only if strictly greater (or NaN): on a tie the earlier index stands.
        tail = logits[:, whole:].max(dim=-1)
        later = (tail.values > values) | tail.values.isnan()
        values = torch.where(later, tail.values, values)
        indices = torch.where(later, tail.indices + whole, indices)
    return values, indices


def draw_key(seed: int, token_index: int) -> int:
    """The generator seed for token ``token_index`` of a request seeded with ``seed``."""
    return (seed ^ ((token_index + 1) * _GOLDEN) ^ ((seed >> 63) * _HIGH_BIT_SALT)) & _MASK63


def apply_repetition_penalty(row: torch.Tensor, seen: Seq[int], penalty: float) -> torch.Tensor:
    """CTRL-style penalty: shrink logits of tokens already seen (divide positives, multiply negatives)."""
    ids = torch.tensor(sorted(set(seen)), dtype=torch.long, device=row.device)
    picked = row.index_select(0, ids)
    row = row.clone()
    row[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return row


def adjust_logits(
    row: torch.Tensor, p: SamplingParams, history: Seq[int], num_output: int, held_back: Seq[int] = ()
) -> torch.Tensor:
    """``row`` (float32) moved by the request's settings, in vLLM's order; returns a new tensor.

    1. ``allowed_token_ids``: every other token is -inf (``NothingAllowed`` when the output
       constraint's mask already forbids them all);
    2. the ``bad_word_ids``: the last token of each where the output ends with the rest of it;
    3. the ``held_back`` tokens banned (what ``min_tokens`` holds back, ``SamplingParams.held_back``);
    4. the logit bias;
    5. the repetition penalty, over prompt and output;
    6. the presence and frequency penalties, over the last ``num_output`` tokens of ``history``:
       the output, resumed tokens included, so a resumed request is penalised as the original was.
    """
    if p.allowed_token_ids:
        ids = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=row.device)
        kept = row.index_select(0, ids)
        if not bool(torch.isfinite(kept).any()):
            raise NothingAllowed(
                "allowed_token_ids", "the output constraint allows none of these tokens here"
            )
        row = torch.full_like(row, float("-inf")).index_copy_(0, ids, kept)
    if p.bad_word_ids:
        written = list(history[len(history) - num_output :]) if num_output > 0 else []
        banned = [word[-1] for word in p.bad_word_ids if _ends_with(written, word[:-1])]
        if banned:
            row = row.index_fill(0, torch.tensor(banned, dtype=torch.long, device=row.device), float("-inf"))
            if not bool(torch.isfinite(row).any()):
                narrowed = "the output constraint" if p.constraint is not None else "allowed_token_ids"
                raise NothingAllowed("bad_words", f"{narrowed} allows only a banned word's token here")
    if held_back:
        held = row.index_fill(0, torch.tensor(held_back, dtype=torch.long, device=row.device), float("-inf"))
        # A constraint that can only end here (its mask left nothing else) ends: banning its one
        # token would leave nothing to draw.
        if bool(torch.isfinite(held).any()):
            row = held
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=row.device)
        bias = torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype, device=row.device)
        row = row.index_add(0, ids, bias)
    if p.repetition_penalty != 1.0:
        row = apply_repetition_penalty(row, history, p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and num_output > 0:
        output = torch.tensor(history[len(history) - num_output :], dtype=torch.long, device=row.device)
        ids, counts = torch.unique(output, return_counts=True)
        penalty = counts.to(row.dtype) * p.frequency_penalty + p.presence_penalty
        row = row.index_add(0, ids, -penalty)
    return row


def _ends_with(tokens: list[int], prefix: tuple[int, ...]) -> bool:
    """``tokens`` ends with ``prefix`` (an empty prefix: always)."""
    return len(prefix) <= len(tokens) and tuple(tokens[len(tokens) - len(prefix) :]) == prefix


def sample_row(row: torch.Tensor, params: SamplingParams, key: int) -> int:
    """Draw one token from a float32 logits row with temperature, top-k and top-p."""
    row = row / params.temperature
    if params.min_p > 0.0:
        # vLLM's order: min_p on the tempered distribution, before top-k and top-p. The likeliest
        # token always stays (its probability is the bar's 1/min_p ≥ 1 times itself).
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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


def apply_guides(logits: torch.Tensor, guides: Seq[Guide | None]) -> dict[int, RowFault]:
    """Mask, in place, every token its row's grammar forbids; rows without a guide are untouched.

    One bitmask row per constrained row is filled by its guide; a row whose grammar allows no
    token at all (its matcher failed) is returned as a fault instead of drawing from -inf.
    """
    rows = [i for i, g in enumerate(guides) if g is not None]
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
    nbytes = words * 4
    faults: dict[int, RowFault] = {}
    for j, i in enumerate(rows):
        guide = guides[i]
        assert guide is not None
        guide.fill(bitmask[j].data_ptr(), nbytes)
        if guide.error:
            reason = f"the output constraint cannot go on: {guide.error}"
            faults[i] = RowFault(reason, invalid_field=guide.field)
    # Bit k of little-endian word w is token 32w + k: unpacking the bytes little-bit-first gives
    # one flag per token in order (numpy's unpackbits: ~20x cheaper than shifting in torch).
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    forbidden = torch.from_numpy(allowed == 0).to(logits.device)
    if len(rows) == logits.shape[0]:  # every row constrained: one in-place fill
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(forbidden, float("-inf")))
    return faults


def token_logprobs(row: torch.Tensor, token: int, top: int) -> SampledToken:
    """The drawn token's log probability under ``row`` (float32 logits) and the ``top`` best."""
    logprobs = torch.log_softmax(row.float(), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logprobs, top)
        # A constrained row may allow fewer than ``top`` tokens: the forbidden ones are no alternative.
        alternatives = tuple(
            (i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if v > -math.inf
        )
    return SampledToken(token, float(logprobs[token]), alternatives)


class Sampler:
    """Picks one token per row of logits."""

    def __init__(self, end_ids: Seq[int] = ()) -> None:
        #: The model's end-of-sequence tokens, which ``min_tokens`` holds back (the engine sets
        #: them once the model is loaded).
        self.end_ids: tuple[int, ...] = tuple(end_ids)

    def _adjusts(self, p: SamplingParams, token_index: int) -> bool:
        """The row's logits move before its draw: it leaves the step's one-argmax fast path."""
        return p.adjusts_logits or (
            token_index < p.min_tokens and bool(p.held_back(token_index, self.end_ids))
        )

    def _adjusted(
        self, row: torch.Tensor, p: SamplingParams, history: Seq[int], token_index: int
    ) -> torch.Tensor:
        """``row`` as the request's settings move it at ``token_index`` (``adjust_logits``)."""
        if not self._adjusts(p, token_index):
            return row
        return adjust_logits(row, p, history, token_index, p.held_back(token_index, self.end_ids))

    def __call__(
        self,
        logits: torch.Tensor,
        params: Seq[SamplingParams],
        seeds: Seq[int],
        token_indices: Seq[int],
        histories: Seq[Seq[int]],
        guides: Seq[Guide | None] = (),
    ) -> Seq[RowResult]:
        """``logits`` is [N, vocab]; the other arguments give each row's request state
        (``guides``: each row's grammar, or None; empty = no row is constrained).

        One token per row (with its logprobs for a row that asked), or a ``RowFault`` for a
        row that could not be drawn.
        """
        faults = apply_guides(logits, guides) if any(g is not None for g in guides) else {}
        # The rows whose logits were adjusted for their draw, kept for their logprobs.
        adjusted: dict[int, torch.Tensor] = {}
        tokens = self._draw_rows(logits, params, seeds, token_indices, histories, adjusted)
        if faults:
            tokens = [faults.get(i, t) for i, t in enumerate(tokens)]
        if not any(p.wants_logprobs for p in params):
            return tokens
        out: list[RowResult] = []
        for i, (p, t) in enumerate(zip(params, tokens, strict=True)):
            if isinstance(t, int) and p.wants_logprobs:
                row = adjusted.get(i)
                if row is None:
                    row = self._adjusted(logits[i].float(), p, histories[i], token_indices[i])
                out.append(token_logprobs(row, t, p.top_logprobs))
            else:
                out.append(t)
        return out

    def _draw_rows(
        self,
        logits: torch.Tensor,
        params: Seq[SamplingParams],
        seeds: Seq[int],
        token_indices: Seq[int],
        histories: Seq[Seq[int]],
        adjusted: dict[int, torch.Tensor],
    ) -> list[int | RowFault]:
        """Each row's token (or fault); the rows that asked for logprobs and were adjusted to
        draw leave their adjusted logits in ``adjusted``, so they are not adjusted twice."""
        # The first maximum, as argmax picks it. Its values check every row for free: a NaN or
        # +inf anywhere in a row makes that row's max so.
        best_values, best_indices = first_max(logits)
        greedy_ids = best_indices.tolist()
        finite = bool(torch.isfinite(best_values).all())
        if finite and all(
            p.greedy and not self._adjusts(p, t) for p, t in zip(params, token_indices, strict=True)
        ):
            return list(greedy_ids)
        row_finite = torch.isfinite(best_values).tolist() if not finite else None
        out: list[int | RowFault] = []
        for i, p in enumerate(params):
            if row_finite is not None and not row_finite[i]:
                out.append(RowFault("the model produced non-finite logits for this request"))
                continue
            if p.greedy and not self._adjusts(p, token_indices[i]):
                out.append(greedy_ids[i])
                continue
            try:
                row = self._adjusted(logits[i].float(), p, histories[i], token_indices[i])
                if p.wants_logprobs:
                    adjusted[i] = row
                out.append(self._draw(row, p, seeds[i], token_indices[i]))
            except NothingAllowed as exc:
                out.append(RowFault(str(exc), invalid_field=exc.field))
            except Exception as exc:  # this row's alone: the step's other rows keep their tokens
                log.exception(
                    "sampling failed for one row (token %d); only its request fails", token_indices[i]
                )
                out.append(RowFault(f"sampling failed: {exc}"))
        return out

    def _draw(self, row: torch.Tensor, p: SamplingParams, seed: int, token_index: int) -> int:
        """One token from ``row``, the request's adjusted fp32 logits (``_adjusted``)."""
        if p.greedy:
            return int(row.argmax().item())
        return sample_row(row, p, draw_key(seed, token_index))
