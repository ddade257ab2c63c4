"""Loading a model and its tokenizer (a local directory or a ``.gguf`` file) on a device and dtype."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from services.inference.paged_attention import ATTENTION_NAME


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_model(path: str, device: torch.device, dtype: torch.dtype) -> Any:
    """A transformers causal LM from a local directory or a ``.gguf`` file, with our attention."""
    p = Path(path)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": ATTENTION_NAME}
    model: Any
    if p.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(p), **kwargs)
    return model.to(device).eval()


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    p = Path(path)
    if p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(str(p))
