"""Owns torch: the weights, the paged KV tensors, and one forward per scheduled batch.

Two implementations run a step. Llama-family models (SmolLM2 included) use the
native forward in ``llama.py``: every scheduled token of the step in one flat
batch, fused matmuls, pre-packed weights. Any other transformers causal LM runs
through its own modules with our attention: we register a paged attention
function with transformers' ``AttentionInterface`` (paged_attention.py) and hand it per-step metadata
(slot mapping, gathered block slots, mask) in a forward-context object passed as
a forward kwarg, so every decoder layer writes its new K/V into the paged cache
and attends over the sequence's blocks; decodes run as one [B, 1] forward and
prefill chunks as one padded forward. Either way the LM head runs on sampled
positions only, and every layer writes the K/V of all prefill chunks of a step
before any chunk attends, which in-step prefix sharing (scheduler) relies on.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from services.inference import decode_slab, llama, memory_budget
from services.inference.config import EngineConfig
from services.inference.host_memory import keep_large_allocations_mapped, release_freed_heap, zeroed
from services.inference.model_loading import load_model, resolve_device, resolve_dtype
from services.inference.paged_attention import ForwardContext
from services.inference.sampler import RowFault, Sampler
from services.inference.scheduler import ScheduledSequence

log = logging.getLogger("llmmesh.inference.runner")

MAX_MODEL_LEN_CAP = 8192
# Auto-sized KV caches stay under this many bytes on CPU (as vLLM's CPU default): the
# host runs other services too. Pages are touched only as blocks fill, so an idle
# replica costs little. 64 sequences of ~1,000 fp32 tokens of SmolLM2 fit without preemption.
CPU_KV_MEMORY_CAP = 4 << 30
# On CUDA, auto-sized KV caches take at most this share of the free memory after loading.
CUDA_KV_MEMORY_SHARE = 0.5
# Decode batches are padded up to one of these sizes when compiling, so few graphs cover all.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class _ModelFacts:
    """What the engine reads from a model once the native forward has taken its weights."""

    config: Any
    generation_config: Any


class ModelRunner:
    """Loads the model, allocates the KV cache, and runs scheduled batches."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and os.environ.get("LLMMESH_GLIBC_TUNING", "1") != "0":
            log.info("glibc malloc tuned for large activations: %s", keep_large_allocations_mapped())
        self.dtype = resolve_dtype(config.dtype, self.device)
        started = time.perf_counter()
        self.model: Any = load_model(config.model, self.device, self.dtype)
        log.info(
            "loaded %s on %s as %s in %.1fs",
            config.model,
            self.device,
            self.dtype,
            time.perf_counter() - started,
        )
        mc: Any = self.model.config
        self.num_layers: int = mc.num_hidden_layers
        self.num_kv_heads: int = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
        self.head_dim: int = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        self.vocab_size: int = mc.vocab_size
        model_len = getattr(mc, "max_position_embeddings", None) or MAX_MODEL_LEN_CAP
        self.max_model_len = min(config.max_model_len or MAX_MODEL_LEN_CAP, model_len, MAX_MODEL_LEN_CAP)
        self.block_size = config.block_size
        self.sampler = Sampler()
        self._block_offsets = torch.arange(self.block_size, device=self.device)
        self.native: llama.LlamaForward | None = None
        if config.model_impl == "native" and not llama.supports(self.model):
            raise ValueError(f"--model-impl native supports Llama-family models, not {mc.model_type!r}")
        if config.model_impl != "transformers" and llama.supports(self.model):
            self.native = llama.LlamaForward(self.model, self.max_model_len)
            # The native forward holds its own (packed) copies: keep only what the engine reads.
            self.model = _ModelFacts(mc, getattr(self.model, "generation_config", None))

        # Sized once the weights are in their final form, so what is resident now stays.
        slab_budget = config.decode_slab_mib << 20
        if self.device.type == "cpu":
            self.num_blocks, slab_budget = self._fit_host_memory(slab_budget)
        else:
            self.num_blocks = config.num_kv_blocks or self._auto_cuda_blocks()
        self.num_slots = self.num_blocks * self.block_size

        # One spare slot at the end takes the K/V of padding tokens. The native forward
        # keeps each KV head's slots together ([kv_heads, slots, D]) so gathered keys feed
        # batched matmuls without a copy; transformers' path keeps [slots, kv_heads, D].
        def cache() -> torch.Tensor:
            slots, heads, dim = self.num_slots + 1, self.num_kv_heads, self.head_dim
            shape = (heads, slots, dim) if self.native is not None else (slots, heads, dim)
            return zeroed(shape, self.dtype, self.device)

        self.k_caches = [cache() for _ in range(self.num_layers)]
        self.v_caches = [cache() for _ in range(self.num_layers)]
        self.slab: decode_slab.DecodeSlab | None = None
        if self.native is not None and slab_budget > 0:
            self.slab = decode_slab.DecodeSlab(
                self.num_layers,
                config.max_num_seqs,
                self.block_size,
                self.num_kv_heads,
                self.head_dim,
                self.dtype,
                self.device,
                budget_bytes=slab_budget,
            )
        self.model_impl = "native" if self.native is not None else "transformers"
        log.info(
            "model implementation: %s; decode slab: %s",
            self.model_impl,
            f"up to {slab_budget >> 20} MiB" if self.slab is not None else "off (decode steps gather)",
        )
        self.decoder: Any = None if self.native is not None else self.model.base_model
        self.lm_head: Any = (
            self.native.logits if self.native is not None else self.model.get_output_embeddings()
        )
        # Decode steps only (shape [B, 1]) are compiled: prefill shapes vary too much.
        compiled = config.compile and self.native is None
        self._decode_forward = self._compiled_forward() if compiled else self._decoder_forward
        self._forward = self._run_forward

    def _bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _context_blocks(self) -> int:
        """Blocks for one sequence of ``max_model_len`` tokens."""
        return -(-self.max_model_len // self.block_size)

    def _full_context_blocks(self) -> int:
        """Blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens: more is never used."""
        return self.config.max_num_seqs * self._context_blocks()

    def _auto_cuda_blocks(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        cap = int(free * CUDA_KV_MEMORY_SHARE)
        return max(2, min(self._full_context_blocks(), cap // self._bytes_per_block()))

    def _fit_host_memory(self, slab_wanted: int) -> tuple[int, int]:
        """KV blocks and slab bytes that fit in the memory this replica may use (memory_budget.py)."""
        release_freed_heap()
        per_block = self._bytes_per_block()
        explicit = self.config.num_kv_blocks
        wanted = explicit or min(self._full_context_blocks(), CPU_KV_MEMORY_CAP // per_block)
        limit = memory_budget.memory_limit(self.config.memory_limit_mib)
        resident = psutil.Process().memory_info().rss
        plan = memory_budget.plan_cpu_memory(limit.bytes, resident, wanted * per_block, slab_wanted)
        blocks = explicit or plan.kv_cache_bytes // per_block
        one_context = self._context_blocks()
        if not explicit and blocks < one_context:
            raise ValueError(
                f"{limit.bytes >> 20} MiB of memory ({limit.source}) leaves {blocks * per_block >> 20} MiB "
                f"for the KV cache after {resident >> 20} MiB resident and "
                f"{memory_budget.ACTIVATION_RESERVE_BYTES >> 20} MiB kept for activations: less than one "
                f"{self.max_model_len}-token context ({one_context * per_block >> 20} MiB). "
                "Raise the memory limit, or lower --max-model-len"
            )
        log.info(
            "memory: %d MiB may be used (%s), %d MiB resident with the weights ready; KV cache %d MiB "
            "(%d blocks, %d tokens), decode slab up to %d MiB",
            limit.bytes >> 20,
            limit.source,
            resident >> 20,
            blocks * per_block >> 20,
            blocks,
            blocks * self.block_size,
            plan.slab_bytes >> 20,
        )
        if explicit and explicit * per_block > plan.kv_cache_bytes:
            log.warning(
                "--kv-blocks %d takes %d MiB, more than the %d MiB the memory limit leaves it: "
                "under load the replica may be killed for memory",
                explicit,
                explicit * per_block >> 20,
                plan.kv_cache_bytes >> 20,
            )
        elif blocks < wanted:
            log.warning(
                "KV cache cut from %d to %d MiB to fit %d MiB (%s): raise the limit or "
                "--memory-limit-mib for more concurrent context",
                wanted * per_block >> 20,
                blocks * per_block >> 20,
                limit.bytes >> 20,
                limit.source,
            )
        return blocks, plan.slab_bytes

    def _compiled_forward(self) -> Any:
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        # Freezing pre-packs weights for oneDNN/MKL (and AMX for bf16): the main CPU win.
        inductor_config.freezing = True
        # One graph per (batch bucket, span bucket): more than dynamo's default of 8,
        # past which it would silently run the rest eagerly.
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        # Static shapes: decode batches are padded to BATCH_BUCKETS and attention spans to
        # powers of two, so a handful of graphs covers every step.
        return torch.compile(self._decoder_forward, dynamic=False)

    def _run_forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor:
        if input_ids.shape[1] == 1:
            return self._decode_forward(input_ids, position_ids, context)  # type: ignore[no-any-return]
        return self._decoder_forward(input_ids, position_ids, context)

    def _decoder_forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor:
        out = self.decoder(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, paged_context=context
        )
        return out.last_hidden_state  # type: ignore[no-any-return]

    @torch.inference_mode()
    def execute(self, scheduled: Seq[ScheduledSequence]) -> Seq[int | RowFault]:
        """Run one step; returns the drawn token (or its row's fault) of every chunk that reached
        its sequence's end, in order."""
        sampling = [s for s in scheduled if s.samples]
        if self.native is not None:
            logits = self._native_logits(scheduled)
        else:
            logits = self._transformers_logits(scheduled)
        if logits is None:
            return []
        return self.sampler(
            logits,
            [s.seq.params for s in sampling],
            [s.seq.seed for s in sampling],
            [s.seq.num_output_tokens for s in sampling],
            [s.seq.token_ids for s in sampling],
        )

    def _transformers_logits(self, scheduled: Seq[ScheduledSequence]) -> torch.Tensor | None:
        decodes = [s for s in scheduled if s.num_tokens == 1]
        prefills = [s for s in scheduled if s.num_tokens > 1]
        rows: dict[int, torch.Tensor] = {}
        # Prefill chunks first: a row may read blocks another chunk of this step fills.
        for group in (prefills, decodes):
            if group:
                hidden = self._run_group(group)
                for s, h in zip(group, hidden, strict=True):
                    if s.samples:
                        rows[id(s)] = h
        sampling = [s for s in scheduled if s.samples]
        if not sampling:
            return None
        return self.lm_head(torch.stack([rows[id(s)] for s in sampling]))  # type: ignore[no-any-return]

    def _native_logits(self, scheduled: Seq[ScheduledSequence]) -> torch.Tensor | None:
        assert self.native is not None
        step, slab_rows = self._step_inputs(scheduled)
        hidden = self.native.hidden_states(step, self.k_caches, self.v_caches)
        if self.slab is not None and slab_rows:
            self.slab.advance(slab_rows)
        if step.sample_index.numel() == 0:
            return None  # only mid-prompt chunks: the layers ran for their K/V
        return self.native.logits(hidden)

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

    def _step_inputs(
        self, scheduled: Seq[ScheduledSequence]
    ) -> tuple[llama.StepInputs, list[decode_slab.SlabRow] | None]:
        """The flat batch of a step: decode rows first (in slab order), then prefill chunks."""
        bs = self.block_size
        dev = self.device
        decodes = [s for s in scheduled if s.num_tokens == 1]
        prefills = [s for s in scheduled if s.num_tokens > 1]
        slab_rows = self._slab_order(decodes)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        flat_index: dict[int, int] = {}  # id(chunk) -> flat index of its last token
        for s in (*decodes, *prefills):
            start, n, table, tokens = s.start, s.num_tokens, s.seq.block_table, s.seq.token_ids
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
        sample_index = [flat_index[id(s)] for s in scheduled if s.samples]
        step = llama.StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=position_t,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decode=decode_rows,
            prefill=prefill_rows,
            sample_index=torch.tensor(sample_index, dtype=torch.long, device=dev),
        )
        return step, slab_rows

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
        )

    def _run_group(self, group: list[ScheduledSequence]) -> list[torch.Tensor]:
        """One forward over rows padded to the longest chunk; returns each row's last hidden state."""
        steps = max(s.num_tokens for s in group)
        rows = len(group)
        bs = self.block_size
        pad_slot = self.num_slots
        max_blocks = max(-(-(s.start + s.num_tokens) // bs) for s in group)
        padded_rows = rows
        if self.config.compile and steps == 1:
            # Few distinct shapes, few compiled graphs.
            padded_rows = next((b for b in BATCH_BUCKETS if b >= rows), rows)
            max_blocks = 1 << (max_blocks - 1).bit_length()
        ids: list[list[int]] = []
        positions: list[list[int]] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        for s in group:
            n, start, table = s.num_tokens, s.start, s.seq.block_table
            pos = list(range(start, start + n))
            ids.append(s.seq.token_ids[start : start + n] + [0] * (steps - n))
            # Pad queries sit at position 0: they see only key 0 and never produce NaN.
            positions.append(pos + [0] * (steps - n))
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            slots.extend([pad_slot] * (steps - n))
            tables.append(table[:max_blocks] + [0] * (max_blocks - len(table[:max_blocks])))
        for _ in range(padded_rows - rows):
            ids.append([0] * steps)
            positions.append([0] * steps)
            slots.extend([pad_slot] * steps)
            tables.append([0] * max_blocks)
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        position_ids = torch.tensor(positions, dtype=torch.long, device=dev)
        block_tables = torch.tensor(tables, dtype=torch.long, device=dev)
        gather = (block_tables[:, :, None] * bs + self._block_offsets).reshape(-1)
        key_pos = torch.arange(max_blocks * bs, device=dev)
        mask = (key_pos[None, None, :] <= position_ids[:, :, None]).unsqueeze(1)
        context = ForwardContext(
            k_caches=self.k_caches,
            v_caches=self.v_caches,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            gather_slots=gather,
            attn_mask=mask,
        )
        hidden = self._forward(input_ids, position_ids, context)
        last = torch.tensor([s.num_tokens - 1 for s in group], device=dev)
        return list(hidden[torch.arange(rows, device=dev), last])

    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self._bytes_per_block()
