"""How many paged KV blocks a replica gets: their size, the CUDA share, and the host-memory plan."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from services.inference import memory_budget
from services.inference.host_memory import release_freed_heap

# The runner's logger: these lines were always the runner's, and operators grep for them.
log = logging.getLogger("llmmesh.inference.runner")

# Auto-sized KV caches stay under this many bytes on CPU (as vLLM's CPU default): the
# host runs other services too. Pages are touched only as blocks fill, so an idle
# replica costs little. 64 sequences of ~1,000 fp32 tokens of SmolLM2 fit without preemption.
CPU_KV_MEMORY_CAP = 4 << 30
# On CUDA, auto-sized KV caches take at most this share of the free memory after loading.
CUDA_KV_MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class KVGeometry:
    """The shape of the model's KV cache, from which every size below follows."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int

    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def context_blocks(self) -> int:
        """Blocks for one sequence of ``max_model_len`` tokens."""
        return -(-self.max_model_len // self.block_size)

    def full_context_blocks(self) -> int:
        """Blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens: more is never used."""
        return self.max_num_seqs * self.context_blocks()


def auto_cuda_blocks(kv: KVGeometry, device: torch.device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    cap = int(free * CUDA_KV_MEMORY_SHARE)
    return max(2, min(kv.full_context_blocks(), cap // kv.bytes_per_block()))


def fit_host_memory(
    kv: KVGeometry,
    num_kv_blocks: int | None,
    memory_limit_mib: int | None,
    slab_wanted: int,
    to_come: int = 0,
) -> tuple[int, int]:
    """KV blocks and slab bytes that fit in the memory this replica may use (memory_budget.py).

    ``to_come``: bytes the replica will hold beside what is resident now, once the cache is sized
    (the compiled decode step's own packed weights): counted as resident already.
    """
    release_freed_heap()
    per_block = kv.bytes_per_block()
    explicit = num_kv_blocks
    wanted = explicit or min(kv.full_context_blocks(), CPU_KV_MEMORY_CAP // per_block)
    limit = memory_budget.memory_limit(memory_limit_mib)
    resident = psutil.Process().memory_info().rss + to_come
    plan = memory_budget.plan_cpu_memory(limit.bytes, resident, wanted * per_block, slab_wanted)
    blocks = explicit or plan.kv_cache_bytes // per_block
    one_context = kv.context_blocks()
    if not explicit and blocks < one_context:
        raise ValueError(
            f"{limit.bytes >> 20} MiB of memory ({limit.source}) leaves {blocks * per_block >> 20} MiB "
            f"for the KV cache after {resident >> 20} MiB resident and "
            f"{memory_budget.ACTIVATION_RESERVE_BYTES >> 20} MiB kept for activations: less than one "
            f"{kv.max_model_len}-token context ({one_context * per_block >> 20} MiB). "
            "Raise the memory limit, or lower --max-model-len"
        )
    coming = f" ({to_come >> 20} MiB of it still to come: the compiled decode step)" if to_come else ""
    log.info(
        "memory: %d MiB may be used (%s), %d MiB resident with the weights ready%s; KV cache %d MiB "
        "(%d blocks, %d tokens), decode slab up to %d MiB",
        limit.bytes >> 20,
        limit.source,
        resident >> 20,
        coming,
        blocks * per_block >> 20,
        blocks,
        blocks * kv.block_size,
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
