"""The native forward's work around its matmuls and attention, as four pure functions.

RMSNorm, rotary embedding, the SiLU gate and the residual add are a dozen small
ops per layer in eager mode, each its own pass over the activations. Kept as
functions of tensors only (weights are arguments, not captured), the same four
serve every layer, so ``compiled_step.py`` can hand them to ``torch.compile``
once and get one fused kernel each for all 30 layers. The math is transformers'
Llama definition step for step (RMSNorm in fp32), so the eager set reproduces
``model.generate``'s fp32 tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after ``delta`` is added, and its RMSNorm."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def rotary(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Splits a fused QKV projection [N, (heads + 2 kv_heads) D] into rotated q, rotated k, and v."""
    n = qkv.shape[0]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = _rotate(q.view(n, heads, dim), cos, sin)
    k = _rotate(k.view(n, kv_heads, dim), cos, sin)
    return q, k, v.view(n, kv_heads, dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class Kernels:
    """One implementation of each function: eager (``EAGER``) or compiled by ``compiled_step``."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    rotary: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, int, int, int],
        tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    # Entered around each step: the compiled set runs there without ever compiling anew.
    step_scope: Callable[[], AbstractContextManager[object]] = field(default=contextlib.nullcontext)


EAGER = Kernels(rms_norm=rms_norm, add_rms_norm=add_rms_norm, rotary=rotary, silu_mul=silu_mul)
