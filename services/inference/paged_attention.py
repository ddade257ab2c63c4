"""Our attention for transformers models: a paged-KV attention op registered with ``AttentionInterface``.

Every decoder layer writes its new K/V into the paged cache and attends over the
sequence's blocks, with per-step metadata (slot mapping, gathered block slots,
mask) handed down as the ``paged_context`` forward kwarg. Importing this module
registers the op under ``ATTENTION_NAME``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "llmmesh_paged"


@dataclass
class ForwardContext:
    """Per-step attention metadata, shared by every layer of one forward.

    transformers hands extra forward kwargs down to the attention function, so the
    context travels as the ``paged_context`` kwarg: no global state, and a compiled
    forward sees its tensors as ordinary inputs.
    """

    k_caches: list[torch.Tensor]  # per layer: [num_slots + 1, kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [B * T] where each new token's K/V goes (pads -> the spare slot)
    gather_slots: torch.Tensor  # [B * L] the cache slots each row attends over, in position order
    attn_mask: torch.Tensor  # [B, 1, T, L] True where query t may see key l


# A custom op, opaque to torch.compile: declaring the cache mutation lets inductor
# update the caches in place instead of copying them whole around every graph.
@torch.library.custom_op("llmmesh::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    gather_slots: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, attend over each row's slots; returns [B, T, heads, D]."""
    batch, kv_heads, steps, head_dim = key.shape
    k_cache.index_copy_(0, slot_mapping, key.transpose(1, 2).reshape(batch * steps, kv_heads, head_dim))
    v_cache.index_copy_(0, slot_mapping, value.transpose(1, 2).reshape(batch * steps, kv_heads, head_dim))
    span = gather_slots.shape[0] // batch
    # index_select is cheaper than advanced indexing for this gather.
    keys = k_cache.index_select(0, gather_slots).view(batch, span, kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, gather_slots).view(batch, span, kv_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=attn_mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous()


@paged_attention_op.register_fake
def _paged_attention_shape(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    gather_slots: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_context: ForwardContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: route each layer to the paged-attention op."""
    ctx = paged_context
    if ctx is None:
        raise RuntimeError("paged attention needs the `paged_context` forward kwarg (see ModelRunner)")
    layer: int = module.layer_idx  # type: ignore[assignment]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention_op(
        query,
        key,
        value,
        ctx.k_caches[layer],
        ctx.v_caches[layer],
        ctx.slot_mapping,
        ctx.gather_slots,
        ctx.attn_mask,
        scale,
    )
    return out, None


AttentionInterface.register(ATTENTION_NAME, paged_attention)
