"""A native forward for Llama-family decoders over the paged KV cache.

transformers' module-per-layer forward costs a padded [B, T] batch, separate
q/k/v and gate/up matmuls, and its attention interface gives no way to run
decode rows and prefill rows in one pass. This forward takes the weights out of
a loaded ``LlamaForCausalLM`` and runs every scheduled token of a step as one
flat [N, hidden] batch: one fused QKV and one fused gate/up matmul per layer
(on CPU with weights pre-packed for oneDNN), attention split into decode rows
(batched matmuls, no padding) and prefill rows (SDPA over padded chunks), and
the LM head on sampled positions only. The math follows transformers' Llama
definition step for step (RMSNorm in fp32, rotary tables from the model's own
``inv_freq``), so fp32 greedy decoding gives ``model.generate``'s tokens.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from services.inference import layer_kernels
from services.inference.decode_slab import DecodeSlab

if TYPE_CHECKING:
    from services.inference.compiled_decode import CompiledDecode

log = logging.getLogger("llmmesh.inference.llama")

# Architectures whose decoder layers are exactly Llama's (no biases, no extra norms).
SUPPORTED_MODEL_TYPES = frozenset({"llama"})
# oneDNN chooses a weight layout for this many rows; any row count still works.
PACK_ROWS_HINT = 64


# Rotary variants whose frequencies depend on the sequence length: not a fixed table.
DYNAMIC_ROPE_TYPES = frozenset({"dynamic", "longrope"})


def rope_type(config: Any) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def supports(model: Any) -> bool:
    """True when ``model`` is a Llama-family causal LM this forward reproduces exactly."""
    config = model.config
    return (
        getattr(config, "model_type", None) in SUPPORTED_MODEL_TYPES
        and rope_type(config) not in DYNAMIC_ROPE_TYPES
        and not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
        and getattr(config, "hidden_act", "silu") == "silu"
        and getattr(config, "pretraining_tp", 1) == 1
        and hasattr(model, "model")
        and hasattr(model.model, "rotary_emb")
    )


class Linear:
    """``x @ W.T``; on CPU through oneDNN with the weight pre-packed once (≈ 1.2× faster here).

    ``keep_weight``: hold the plain weight beside the packed one, for a compiled graph that
    packs its own copy (compiled_decode.py); otherwise the packed copy is all there is.
    """

    def __init__(self, weight: torch.Tensor, keep_weight: bool = False) -> None:
        weight = weight.detach().contiguous()
        self.packed: torch.Tensor | None = None
        if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
            except RuntimeError as exc:  # e.g. a dtype oneDNN does not pack: plain matmul
                log.info("weight not packed for oneDNN (%s); using F.linear", exc)
        # Its own storage, not a view into the checkpoint's (see LlamaForward).
        self.weight: torch.Tensor | None = weight.clone() if self.packed is None or keep_weight else None

    @property
    def plain(self) -> torch.Tensor:
        """The unpacked weight (kept only with ``keep_weight`` when packed)."""
        assert self.weight is not None, "Linear built without keep_weight"
        return self.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")  # type: ignore[no-any-return]
        assert self.weight is not None
        return F.linear(x, self.weight)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


@dataclass
class DecodeRows:
    """The single-token rows of a step (the first ``count`` tokens of the flat batch).

    Keys come from the decode slab when it holds the batch (row i of the batch is
    slab row i), else they are gathered from the paged cache through ``gather_slots``.
    """

    count: int
    span: int
    # Slab: [count, 1, 1, span]; gather: [1, count, 1, span]. 0 where the key is visible, -inf not.
    mask_bias: torch.Tensor
    # [count * span] cache slots each row attends over, in position order (gather only).
    gather_slots: torch.Tensor | None = None
    slab: DecodeSlab | None = None
    positions: torch.Tensor | None = None  # [count] each row's new position (slab only)


@dataclass
class PrefillRows:
    """The multi-token rows of a step (the flat batch's tokens after the decode rows)."""

    rows: int
    steps: int  # longest chunk; shorter ones are padded in attention only
    # [tokens] where each flat token sits in the padded [rows * steps] layout; None when no padding.
    pad_index: torch.Tensor | None
    gather_slots: torch.Tensor  # [rows * span]
    span: int
    mask: torch.Tensor  # [rows, 1, steps, span] True where the query may see the key
    # Set when padding every row to the longest would waste most of the attention (prompts of
    # mixed lengths): each row's (first flat token, tokens, keys it sees), attended one by one.
    chunks: tuple[tuple[int, int, int], ...] | None = None


@dataclass
class StepInputs:
    """Everything one forward needs besides the weights and the cache."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N] where each token's K/V is written
    decode: DecodeRows | None
    prefill: PrefillRows | None
    # [S] flat indices of the tokens whose next-token logits are wanted.
    sample_index: torch.Tensor


class Scratch:
    """Reusable buffers for the per-layer K/V gathers.

    A gather for 64 rows of 800 positions is tens of MB: allocated fresh each layer it
    is mmapped and page-faulted every time (glibc serves large blocks with mmap), which
    cost 7x the copy itself. One buffer per name, grown when a step needs more.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


def same_shape_runs(
    chunks: tuple[tuple[int, int, int], ...],
) -> list[tuple[int, int, int, int, int]]:
    """Prefill rows ``(first flat token, tokens, keys seen)`` as runs of consecutive rows alike in
    ``tokens`` and ``keys seen``: ``(first row, rows, first flat token, tokens, keys seen)``.

    Prompts from one template (a system prompt, then a short question) prefill this way: the
    shared opening computed once, then every row's own tail, all of one length. One attention
    call per run instead of per row: a call costs ~30 µs of setup beside its few µs of work."""
    runs: list[tuple[int, int, int, int, int]] = []
    for i, (first, tokens, seen) in enumerate(chunks):
        if runs:
            row, count, start, run_tokens, run_seen = runs[-1]
            if (tokens, seen) == (run_tokens, run_seen) and first == start + count * tokens:
                runs[-1] = (row, count + 1, start, tokens, seen)
                continue
        runs.append((i, 1, first, tokens, seen))
    return runs


def gather_slots(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``cache[:, slots]`` for a [kv_heads, slots, D] cache, written into ``out``."""
    return torch.index_select(cache, 1, slots, out=out)


def slab_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask_bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode attention of ``q`` [b, heads, D] over slab rows ``keys``/``values`` [b, kv_heads, span, D].

    One query per row: the heads sharing a KV head form a [group, D] matrix, so two
    batched matmuls do the work SDPA's kernel spends most of its time setting up.
    """
    b, heads, dim = q.shape
    kv_heads = keys.shape[1]
    queries = q.view(b, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale + mask_bias
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values).reshape(b, heads, dim)


def write_slab_rows(
    slab_k: torch.Tensor, slab_v: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Row i of the decode batch writes its new K/V [kv_heads, D] at ``positions[i]`` of slab row i."""
    rows = torch.arange(positions.shape[0], device=positions.device)
    slab_k[rows, :, positions] = k
    slab_v[rows, :, positions] = v


class LlamaForward:
    """Runs steps of a Llama-family model whose weights it took from ``model``."""

    def __init__(self, model: Any, max_positions: int, keep_weights: bool = False) -> None:
        """``keep_weights``: keep the unpacked linear weights too (for compiled_decode.py)."""
        config = model.config
        self.keep_weights = keep_weights
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.group = self.num_heads // self.num_kv_heads
        self.eps: float = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        decoder = model.model
        # Own copies (clone), not views: the loader's tensors may share one storage mapped from
        # the checkpoint file, and one view kept alive would keep all of it resident.
        self.embed: torch.Tensor = decoder.embed_tokens.weight.detach().clone()
        self.final_norm: torch.Tensor = decoder.norm.weight.detach().clone()
        self.layers = [self._layer(layer) for layer in decoder.layers]
        self.lm_head = Linear(model.get_output_embeddings().weight)
        self.cos, self.sin = self._rotary_tables(decoder.rotary_emb, max_positions)
        self.scratch = Scratch()
        # The work around the matmuls and attention: eager, or compiled (compiled_step.py).
        self.kernels: layer_kernels.Kernels = layer_kernels.EAGER
        # --compile on CPU: whole pure-decode steps as one graph (compiled_decode.py).
        self.decode_graph: CompiledDecode | None = None

    def decode_graph_bytes(self) -> int:
        """What compiling the decode step will add: the graph's own packed copy of the layers'
        linear weights (0 unless built with ``keep_weights``)."""
        if not self.keep_weights:
            return 0
        linears = [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(w.plain.numel() * w.plain.element_size() for w in linears)

    def _layer(self, layer: Any) -> LayerWeights:
        attn, mlp, keep = layer.self_attn, layer.mlp, self.keep_weights
        return LayerWeights(
            input_norm=layer.input_layernorm.weight.detach().clone(),
            post_attention_norm=layer.post_attention_layernorm.weight.detach().clone(),
            qkv=Linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), keep),
            o=Linear(attn.o_proj.weight, keep),
            gate_up=Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), keep),
            down=Linear(mlp.down_proj.weight, keep),
        )

    def _rotary_tables(self, rotary: Any, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        # As transformers computes them (fp32 outer product, cat, cos/sin, scaling), once.
        inv_freq = rotary.inv_freq.detach().float()
        positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        dtype = self.embed.dtype
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

    def rotary_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos and sin rows of ``positions``: [N, 1, D] each."""
        return (
            self.cos.index_select(0, positions)[:, None, :],
            self.sin.index_select(0, positions)[:, None, :],
        )

    def hidden_states(
        self, step: StepInputs, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
    ) -> torch.Tensor:
        """The final-normed hidden state of every token in ``step.sample_index``: [S, hidden]."""
        cos, sin = self.rotary_rows(step.positions)
        with self.kernels.step_scope():
            graph = self.decode_graph
            if graph is not None and graph.usable(step):
                return graph(step, cos, sin, k_caches, v_caches).index_select(0, step.sample_index)
            return self.eager_hidden_states(step, cos, sin, k_caches, v_caches)

    def eager_hidden_states(
        self,
        step: StepInputs,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """``hidden_states`` through the layer-by-layer forward (the compiled decode step's alternative)."""
        x = self.embed.index_select(0, step.input_ids)
        return self._layers(step, x, cos, sin, k_caches, v_caches)

    def _layers(
        self,
        step: StepInputs,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        n = step.input_ids.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        kernels = self.kernels
        h = kernels.rms_norm(x, self.layers[0].input_norm, self.eps)
        for index, (layer, k_cache, v_cache) in enumerate(zip(self.layers, k_caches, v_caches, strict=True)):
            q, k, v = kernels.rotary(layer.qkv(h), cos, sin, heads, kv_heads, dim)
            # Every row's K/V is written before any row attends: a prefill row may
            # read blocks another row of this same step fills (in-step prefix sharing).
            k_cache.index_copy_(1, step.slot_mapping, k.transpose(0, 1))
            v_cache.index_copy_(1, step.slot_mapping, v.transpose(0, 1))
            decode = step.decode
            if decode is not None and decode.slab is not None:
                assert decode.positions is not None
                count = decode.count
                write_slab_rows(
                    decode.slab.k[index], decode.slab.v[index], decode.positions, k[:count], v[:count]
                )
            attn = self._attention(q, index, k_cache, v_cache, step)
            # reshape, not view: SDPA's output layout depends on the kernel that ran (CUDA's
            # and CPU's math kernels leave [rows, heads, steps, D] strides), so one prefill
            # row may need a copy here.
            x, h = kernels.add_rms_norm(
                x, layer.o(attn.reshape(n, heads * dim)), layer.post_attention_norm, self.eps
            )
            down = layer.down(kernels.silu_mul(layer.gate_up(h)))
            if index + 1 < len(self.layers):
                # The residual add and the next layer's input norm in one call (one kernel compiled).
                x, h = kernels.add_rms_norm(x, down, self.layers[index + 1].input_norm, self.eps)
            else:
                x = x + down
        return kernels.rms_norm(x.index_select(0, step.sample_index), self.final_norm, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def _attention(
        self, q: torch.Tensor, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepInputs
    ) -> torch.Tensor:
        decode, prefill = step.decode, step.prefill
        if decode is not None and prefill is None:
            return self._decode_attention(q, layer, k_cache, v_cache, decode)
        if prefill is not None and decode is None:
            return self._prefill_attention(q, k_cache, v_cache, prefill)
        assert decode is not None and prefill is not None
        head = self._decode_attention(q[: decode.count], layer, k_cache, v_cache, decode)
        tail = self._prefill_attention(q[decode.count :], k_cache, v_cache, prefill)
        return torch.cat((head, tail))

    def _decode_attention(
        self, q: torch.Tensor, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: DecodeRows
    ) -> torch.Tensor:
        # One query per row: the heads sharing a KV head form a [group, D] matrix, so
        # two batched matmuls do the work SDPA's kernel spends most of its time setting up.
        b, kv_heads, dim, span = rows.count, self.num_kv_heads, self.head_dim, rows.span
        if rows.slab is not None:
            # Slab rows [b, kv_heads, span, D] are a view: nothing is copied.
            keys = rows.slab.k[layer][:b, :, :span]
            values = rows.slab.v[layer][:b, :, :span]
            return slab_attention(q, keys, values, rows.mask_bias, self.scale)
        # Gathered from the [kv_heads, slots, D] cache the keys are already
        # [kv_heads, rows, span, D] and feed the matmuls without a further copy.
        assert rows.gather_slots is not None
        shape = (kv_heads, b * span, dim)
        keys = gather_slots(k_cache, rows.gather_slots, self.scratch.get("k", shape, k_cache))
        values = gather_slots(v_cache, rows.gather_slots, self.scratch.get("v", shape, v_cache))
        keys = keys.view(kv_heads, b, span, dim)
        values = values.view(kv_heads, b, span, dim)
        queries = q.view(b, kv_heads, self.group, dim).transpose(0, 1)
        scores = torch.matmul(queries, keys.transpose(-1, -2)) * self.scale + rows.mask_bias
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, values)  # [kv_heads, b, group, D]
        return out.transpose(0, 1).reshape(b, self.num_heads, dim)

    def _prefill_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: PrefillRows
    ) -> torch.Tensor:
        r, t, span = rows.rows, rows.steps, rows.span
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        shape = (kv_heads, r * span, dim)
        keys = gather_slots(k_cache, rows.gather_slots, self.scratch.get("prefill_k", shape, k_cache))
        values = gather_slots(v_cache, rows.gather_slots, self.scratch.get("prefill_v", shape, v_cache))
        keys = keys.view(kv_heads, r, span, dim).transpose(0, 1)
        values = values.view(kv_heads, r, span, dim).transpose(0, 1)
        if rows.chunks is not None:
            return self._prefill_attention_by_row(q, keys, values, rows.mask, rows.chunks)
        if rows.pad_index is not None:
            padded = q.new_zeros(r * t, heads, dim).index_copy_(0, rows.pad_index, q)
        else:
            padded = q
        out = F.scaled_dot_product_attention(
            padded.view(r, t, heads, dim).transpose(1, 2),
            keys,
            values,
            attn_mask=rows.mask,
            scale=self.scale,
            enable_gqa=True,
        )
        out = out.transpose(1, 2).reshape(r * t, heads, dim)
        if rows.pad_index is not None:
            out = out.index_select(0, rows.pad_index)
        return out

    def _prefill_attention_by_row(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        chunks: tuple[tuple[int, int, int], ...],
    ) -> torch.Tensor:
        """Each row over its own tokens and keys: no padded queries or keys to attend for nothing.

        A step prefilling prompts of 40 and 300 tokens pads both to 300 × 300 in the batched
        call; one call per row did the same work 2.3× faster (docs/inference.md). The mask
        slices keep each row's causal view, cached prefix included.
        """
        heads, dim = self.num_heads, self.head_dim
        out = torch.empty_like(q)
        for i, count, first, tokens, seen in same_shape_runs(chunks):
            # ``count`` consecutive rows alike in tokens and keys seen (so in their causal mask,
            # which depends only on those): one call for them all, their queries a view.
            query = q[first : first + count * tokens].reshape(count, tokens, heads, dim).transpose(1, 2)
            attended = F.scaled_dot_product_attention(
                query,
                keys[i : i + count, :, :seen],
                values[i : i + count, :, :seen],
                attn_mask=mask[i : i + 1, :, :tokens, :seen],
                scale=self.scale,
                enable_gqa=True,
            )
            out[first : first + count * tokens] = attended.transpose(1, 2).reshape(count * tokens, heads, dim)
        return out
