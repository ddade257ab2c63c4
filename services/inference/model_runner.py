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

The native forward's flat batch is built in ``flat_batch.py``; how many KV blocks
the cache gets is ``kv_sizing.py``'s answer.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from services.inference import compiled_decode, compiled_step, decode_slab, llama
from services.inference.config import EngineConfig
from services.inference.flat_batch import FlatBatchBuilder, PromptScoring, reads_whole_slab_rows
from services.inference.grammar import Guide
from services.inference.host_memory import keep_large_allocations_mapped, zeroed
from services.inference.kv_sizing import KVGeometry, auto_cuda_blocks, fit_host_memory
from services.inference.model_loading import load_model, resolve_device, resolve_dtype
from services.inference.outputs import SampledToken
from services.inference.paged_attention import ForwardContext
from services.inference.sampler import RowResult, Sampler
from services.inference.scheduler import ScheduledSequence

log = logging.getLogger("llmmesh.inference.runner")

MAX_MODEL_LEN_CAP = 8192
#: Prompt positions whose logits are made at once when scoring a prompt: a [rows, vocab] fp32
#: block is 192 KiB a row for a 49,152-token vocabulary, so 256 rows hold 48 MiB where a whole
#: 2,048-token chunk would take 384.
SCORE_ROWS = 256
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
            # The compiled decode step (CPU) packs its own copy of the linear weights.
            compile_decode = config.compile and self.device.type == "cpu"
            self.native = llama.LlamaForward(self.model, self.max_model_len, keep_weights=compile_decode)
            if config.compile:
                # Here, before the replica reports SERVING: never on a live request.
                self.native.kernels = compiled_step.compile_kernels(
                    hidden=mc.hidden_size,
                    intermediate=mc.intermediate_size,
                    heads=self.native.num_heads,
                    kv_heads=self.native.num_kv_heads,
                    head_dim=self.native.head_dim,
                    eps=self.native.eps,
                    dtype=self.dtype,
                    device=self.device,
                    max_rows=max(config.max_num_seqs, config.max_num_batched_tokens),
                )
            # The native forward holds its own (packed) copies: keep only what the engine reads.
            self.model = _ModelFacts(mc, getattr(self.model, "generation_config", None))

        # Sized once the weights are in their final form, so what is resident now stays.
        self.kv = KVGeometry(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            self.dtype,
            self.max_model_len,
            config.max_num_seqs,
        )
        slab_budget = config.decode_slab_mib << 20
        if self.device.type == "cpu":
            self.num_blocks, slab_budget = fit_host_memory(
                self.kv,
                config.num_kv_blocks,
                config.memory_limit_mib,
                slab_budget,
                # Compiled after the cache is sized (its warm-up needs the slab): counted now.
                to_come=compiled_decode.memory_to_come(self.native) if self.native is not None else 0,
            )
        else:
            self.num_blocks = config.num_kv_blocks or auto_cuda_blocks(self.kv, self.device)
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
                whole_rows=reads_whole_slab_rows(self.device, self.dtype),
            )
        self.flat_batch = FlatBatchBuilder(
            self.block_size, self.device, self.dtype, self.k_caches, self.v_caches, self.slab
        )
        if self.native is not None and self.native.keep_weights and self.slab is not None:
            # Here too before SERVING: whole decode steps over the slab as one graph.
            self.native.decode_graph = compiled_decode.compile_decode(
                self.native,
                self.slab,
                self.k_caches,
                self.v_caches,
                self.num_slots,
                config.max_num_seqs,
                whole_length=self.flat_batch.whole_slab_rows,
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
        # transformers path: decode steps only (shape [B, 1]) are compiled, prefill shapes vary too much.
        compiled = config.compile and self.native is None
        self._decode_forward = self._compiled_forward() if compiled else self._decoder_forward
        self._forward = self._run_forward

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
    def execute(self, scheduled: Seq[ScheduledSequence], guides: Seq[Guide | None] = ()) -> Seq[RowResult]:
        """Run one step; returns the drawn token (or its row's fault) of every chunk that reached
        its sequence's end, in order. ``guides``: those chunks' grammars (None = free), or empty."""
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
            guides,
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
        step, slab_rows, scoring = self.flat_batch.build(scheduled)
        hidden = self.native.hidden_states(step, self.k_caches, self.v_caches)
        if self.slab is not None and slab_rows:
            self.slab.advance(slab_rows)
        sampled = hidden.shape[0] - sum(r.count for r in scoring)
        if scoring:
            self._score_prompts(hidden[sampled:], scoring)
        if sampled == 0:
            return None  # only mid-prompt chunks: the layers ran for their K/V
        return self.native.logits(hidden[:sampled])

    def _score_prompts(self, hidden: torch.Tensor, scoring: Seq[PromptScoring]) -> None:
        """Each scored prompt token's log probability (and its alternatives), into its sequence's
        ``prompt_logprobs`` by position: a chunk computed again (after a preemption, or in fault
        isolation's halves) writes the same entries again, never more of them."""
        assert self.native is not None
        targets: list[int] = []
        for r in scoring:
            targets.extend(r.seq.token_ids[r.first_target : r.first_target + r.count])
        top = max(r.seq.params.prompt_logprobs or 0 for r in scoring)
        target_t = torch.tensor(targets, dtype=torch.long, device=hidden.device)
        chosen: list[float] = []
        alternatives: list[list[tuple[int, float]]] = []
        for first in range(0, hidden.shape[0], SCORE_ROWS):
            rows = slice(first, first + SCORE_ROWS)
            logprobs = torch.log_softmax(self.native.logits(hidden[rows]).float(), dim=-1)
            chosen.extend(logprobs.gather(1, target_t[rows, None]).squeeze(1).tolist())
            if top:
                values, ids = torch.topk(logprobs, top)
                alternatives.extend(
                    list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
                )
        row = 0
        for r in scoring:
            store, k = r.seq.prompt_logprobs, r.seq.params.prompt_logprobs or 0
            assert store is not None
            for position in range(r.first_target, r.first_target + r.count):
                alts = tuple(alternatives[row][:k]) if k else ()
                store[position] = SampledToken(targets[row], chosen[row], alts)
                row += 1

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
        return self.num_blocks * self.kv.bytes_per_block()
