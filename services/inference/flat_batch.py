"""The native forward's flat batch: one step's scheduled chunks as ``llama.StepInputs``.

Decode rows come first (in decode-slab row order when the slab holds them, else
with the block slots to gather), then prefill chunks padded to the longest.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from services.inference import decode_slab, llama
from services.inference.scheduler import ScheduledSequence
from services.inference.sequence import Sequence


@dataclass(frozen=True)
class PromptScoring:
    """``count`` rows of the step's output, after the sampled ones, whose logits score a prompt:
    the first row's predict ``seq``'s prompt token ``first_target``, the next the one after it."""

    seq: Sequence
    first_target: int
    count: int


def reads_whole_slab_rows(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention over the slab reads every allocated position of its rows (see
    ``FlatBatchBuilder._slab_decode_rows``): on CPU in reduced precision only. fp32's batched
    matmul reads strided rows in place, so the masked tail would be work for nothing there
    (and fp32 keeps HF's exact arithmetic)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


class FlatBatchBuilder:
    """Builds each step's inputs over one replica's paged KV cache (and decode slab, if any)."""

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        slab: decode_slab.DecodeSlab | None,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.slab = slab
        self._block_offsets = torch.arange(block_size, device=device)
        self.whole_slab_rows = reads_whole_slab_rows(device, dtype)

    def _slab_order(self, decodes: list[ScheduledSequence]) -> list[decode_slab.SlabRow] | None:
        """Put the decode rows in slab-row order; None (gather instead) when the slab cannot hold them."""
        if self.slab is None:
            return None
        if any(s.admitted for s in decodes):
            # Its prefix may sit in blocks this step's prefill is writing: not yet copyable.
            self.slab.release_all()
            return None
        rows = [decode_slab.SlabRow(s.seq.request_id, s.start, s.seq.block_table) for s in decodes]
        index = self.slab.prepare(rows, self.k_caches, self.v_caches)
        if index is None:
            return None
        order = sorted(range(len(decodes)), key=index.__getitem__)
        decodes[:] = [decodes[i] for i in order]
        return [rows[i] for i in order]

    def build(
        self, scheduled: Seq[ScheduledSequence]
    ) -> tuple[llama.StepInputs, list[decode_slab.SlabRow] | None, list[PromptScoring]]:
        """The flat batch of a step: decode rows first (in slab order), then prefill chunks.

        ``sample_index`` lists the sampled chunks' last tokens, then the positions that score a
        prompt (``PromptScoring``, for requests that asked for prompt logprobs)."""
        bs = self.block_size
        dev = self.device
        decodes = [s for s in scheduled if s.num_tokens == 1]
        prefills = [s for s in scheduled if s.num_tokens > 1]
        slab_rows = self._slab_order(decodes)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        flat_index: dict[int, int] = {}  # id(chunk) -> flat index of its last token
        scoring: list[PromptScoring] = []
        score_index: list[int] = []
        for s in (*decodes, *prefills):
            start, n, table, tokens = s.start, s.num_tokens, s.seq.block_table, s.seq.token_ids
            if s.seq.prompt_logprobs is not None:
                # Position p's logits score prompt token p + 1; the last prompt position's draw
                # the first output token instead.
                end = min(start + n, s.seq.num_prompt_tokens - 1)
                if end > start:
                    scoring.append(PromptScoring(s.seq, start + 1, end - start))
                    score_index.extend(range(len(ids), len(ids) + end - start))
            ids.extend(tokens[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            flat_index[id(s)] = len(ids) - 1
        position_t = torch.tensor(positions, dtype=torch.long, device=dev)
        decode_rows = None
        if decodes:
            decode_positions = position_t[: len(decodes)]
            if slab_rows is not None:
                decode_rows = self._slab_decode_rows(decodes, decode_positions)
            else:
                decode_rows = self._decode_rows(decodes, decode_positions)
        prefill_rows = self._prefill_rows(prefills) if prefills else None
        sample_index = [flat_index[id(s)] for s in scheduled if s.samples] + score_index
        step = llama.StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=position_t,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decode=decode_rows,
            prefill=prefill_rows,
            sample_index=torch.tensor(sample_index, dtype=torch.long, device=dev),
        )
        return step, slab_rows, scoring

    def _visible_bias(self, span: int, positions: torch.Tensor) -> torch.Tensor:
        """[rows, span]: 0 where key position <= the row's position, -inf after it."""
        key_pos = torch.arange(span, device=self.device)
        visible = key_pos[None, :] <= positions[:, None]
        return torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(
            ~visible, float("-inf")
        )

    def _slab_decode_rows(
        self, decodes: list[ScheduledSequence], positions: torch.Tensor
    ) -> llama.DecodeRows:
        span = max(s.start for s in decodes) + 1
        if self.whole_slab_rows and self.slab is not None and 2 * span >= self.slab.length:
            # The rows' whole allocated length (the positions past each row's own are masked as
            # before): then slab[:n] is contiguous and oneDNN's bf16/fp16 batched matmul reads
            # it in place. Over a shorter span the rows are strided by the slab's length, and
            # that matmul copies both operands on every call: decode attention over 30 layers at
            # 48 rows took 108 ms a step at span 460 that way, 34 ms over the whole 512, and the
            # whole length was the faster down to span = length / 2, as far as measured
            # (docs/benchmarks.md, "bf16 `uniform` on an AVX512_BF16 host"). Such a slab follows
            # the batch's length down as well as up (decode_slab.py), so a shorter span is the
            # exception: a slab the budget could not shrink, or rows under 32 positions.
            span = self.slab.length
        return llama.DecodeRows(
            count=len(decodes),
            span=span,
            mask_bias=self._visible_bias(span, positions)[:, None, None, :],
            slab=self.slab,
            positions=positions,
        )

    def _block_tables(self, group: Seq[ScheduledSequence], max_blocks: int) -> torch.Tensor:
        # Short tables are padded with block 0; those keys are masked out.
        return torch.tensor(
            [
                s.seq.block_table[:max_blocks] + [0] * (max_blocks - len(s.seq.block_table[:max_blocks]))
                for s in group
            ],
            dtype=torch.long,
            device=self.device,
        )

    def _decode_rows(self, decodes: list[ScheduledSequence], positions: torch.Tensor) -> llama.DecodeRows:
        bs = self.block_size
        max_blocks = max(s.start // bs + 1 for s in decodes)
        tables = self._block_tables(decodes, max_blocks)
        span = max_blocks * bs
        return llama.DecodeRows(
            count=len(decodes),
            span=span,
            mask_bias=self._visible_bias(span, positions)[None, :, None, :],
            gather_slots=(tables[:, :, None] * bs + self._block_offsets).reshape(-1),
        )

    def _prefill_rows(self, prefills: list[ScheduledSequence]) -> llama.PrefillRows:
        bs = self.block_size
        dev = self.device
        steps = max(s.num_tokens for s in prefills)
        max_blocks = max(-(-(s.start + s.num_tokens) // bs) for s in prefills)
        tables = self._block_tables(prefills, max_blocks)
        span = max_blocks * bs
        # Pad queries sit at position 0: they see only key 0 and never produce NaN.
        padded_positions = torch.tensor(
            [list(range(s.start, s.start + s.num_tokens)) + [0] * (steps - s.num_tokens) for s in prefills],
            dtype=torch.long,
            device=dev,
        )
        key_pos = torch.arange(span, device=dev)
        mask = (key_pos[None, None, :] <= padded_positions[:, :, None]).unsqueeze(1)
        pad_index = None
        if any(s.num_tokens != steps for s in prefills):
            pad_index = torch.tensor(
                [r * steps + j for r, s in enumerate(prefills) for j in range(s.num_tokens)],
                dtype=torch.long,
                device=dev,
            )
        return llama.PrefillRows(
            rows=len(prefills),
            steps=steps,
            pad_index=pad_index,
            gather_slots=(tables[:, :, None] * bs + self._block_offsets).reshape(-1),
            span=span,
            mask=mask,
            chunks=_row_chunks(prefills, steps, span),
        )


#: Attend prefill rows one by one once padding them to the longest would do this many times the
#: attention work they need (query tokens × keys seen, summed over rows).
PER_ROW_PADDING_WASTE = 1.5


def _row_chunks(
    prefills: Seq[ScheduledSequence], steps: int, span: int
) -> tuple[tuple[int, int, int], ...] | None:
    """Each row's (first flat token, tokens, keys seen) when attending row by row is the cheaper."""
    needed = sum(s.num_tokens * (s.start + s.num_tokens) for s in prefills)
    if len(prefills) < 2 or len(prefills) * steps * span < PER_ROW_PADDING_WASTE * needed:
        return None
    chunks, first = [], 0
    for s in prefills:
        chunks.append((first, s.num_tokens, s.start + s.num_tokens))
        first += s.num_tokens
    return tuple(chunks)
