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


def check_model_path(path: str) -> None:
    """``FileNotFoundError`` naming ``--model`` when a local model is not there (an unmounted
    volume, a typo): transformers would take the path for a hub id and fail on its syntax or
    on the network, which says nothing of the path. Nothing is downloaded from a hub at run
    time, so a hub id is no model either."""
    p = Path(path)
    if p.is_dir() and (p / "config.json").is_file():
        return
    if p.is_file() and p.suffix == ".gguf":
        return
    what = (
        "a directory without config.json"
        if p.is_dir()
        else "nothing there"
        if not p.exists()
        else "not a .gguf file"
    )
    raise FileNotFoundError(
        f"--model {path}: {what}; a model is a directory with config.json, or a .gguf file"
    )


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
