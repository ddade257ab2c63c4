"""Engine configuration: one frozen dataclass, checked when built; its fields are the replica's flags."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import flag

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# native: our flat-batch Llama forward (llama.py); transformers: the model's own modules
# with paged attention (any causal LM); auto: native when the architecture allows.
MODEL_IMPLS = ("auto", "native", "transformers")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load a model and size its batch and KV cache."""

    model: str = flag(help="model directory or .gguf file")
    model_id: str | None = flag(None, help="name reported to clients (default: from the path)")
    device: str = flag("auto", help=f"one of {', '.join(DEVICES)} or cuda:N")
    dtype: str = flag("auto", choices=DTYPES, help="weights and KV-cache dtype")
    max_num_seqs: int = flag(64, help="most sequences in the running batch")
    max_num_batched_tokens: int = flag(2048, help="token budget per step")
    block_size: int = flag(16, help="tokens per KV-cache block")
    # None: enough blocks for max_num_seqs full contexts, under a memory cap.
    num_kv_blocks: int | None = flag(
        None, name="--kv-blocks", type=int, help="KV-cache blocks (default: auto)"
    )
    max_queued_requests: int = flag(256, help="waiting-queue bound")
    # None: the model's own context length, capped (see model_runner.MAX_MODEL_LEN_CAP).
    max_model_len: int | None = flag(None, type=int, help="context cap (default: the model's)")
    # Off by default: minutes of start-up and ~2x the weights in memory (docs/inference.md).
    # Native forward: the whole decode step on CPU (compiled_decode.py) and its per-layer
    # kernels (compiled_step.py); transformers: its decode step.
    compile: bool = flag(
        False,
        help="torch.compile the forward at start-up (native: the decode step and per-layer kernels; "
        "minutes of start-up)",
    )
    model_impl: str = flag(
        "auto",
        choices=MODEL_IMPLS,
        help="native: flat-batch Llama forward; transformers: any causal LM; auto: native when possible",
    )
    # Native forward: MiB for contiguous decode K/V rows (decode_slab.py); 0 disables.
    # 1 GiB holds 64 fp32 SmolLM2 rows of up to 256 tokens, or 8 of up to 2,048; a batch
    # needing more gathers from the paged cache instead.
    decode_slab_mib: int = flag(
        1024,
        help="native forward: memory for contiguous decode K/V rows (0 = always gather from the paged cache)",
    )
    # CPU: the memory the replica may use (None: the container's cgroup limit, else the
    # machine's RAM); the auto-sized KV cache and the slab shrink to fit it (memory_budget.py).
    memory_limit_mib: int | None = flag(
        None,
        type=int,
        help="CPU: memory this replica may use; the auto-sized KV cache and decode slab fit in it "
        "(default: the container's cgroup limit, else the machine's RAM)",
    )

    def __post_init__(self) -> None:
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES} or cuda:N, got {self.device!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.memory_limit_mib is not None and self.memory_limit_mib < 1:
            raise ValueError(f"memory_limit_mib must be >= 1, got {self.memory_limit_mib}")
        if self.decode_slab_mib < 0:
            raise ValueError(f"decode_slab_mib must be >= 0, got {self.decode_slab_mib}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
