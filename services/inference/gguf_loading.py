"""Loading a ``.gguf`` file through transformers without reading it three times over.

transformers reads a GGUF file from scratch for each of the config, the tokenizer and the weights,
and gguf's reader walks the whole vocabulary array one numpy view at a time (≈ 13 s a read for
SmolLM2's 49k tokens on a 2-vCPU VM). Mapping the weights' names then rebuilds the same
``TensorNameMap`` once per module of the model (≈ 400 times, ≈ 13 s). Inside ``gguf_read_once()``
both are built once per file: a replica starting from the GGUF goes from ≈ 50 s to ≈ 16 s there.

Both names are looked up on the ``gguf`` module at call time (transformers imports them inside
its functions), so swapping the module's attributes for the duration of a load reaches them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

# Loads in one process run one at a time: the swap is process-wide.
_lock = threading.Lock()


@contextlib.contextmanager
def gguf_read_once(model: str | os.PathLike[str]) -> Iterator[None]:
    """While open, each GGUF file is parsed once and each tensor-name map built once.

    Does nothing (not even import gguf) unless ``model`` is a ``.gguf`` file.
    """
    if not os.fspath(model).endswith(".gguf"):
        yield
        return
    try:
        import gguf
    except ImportError:  # no GGUF support installed: transformers will say so
        yield
        return
    with _lock:
        make_reader, make_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], Any] = {}

        def reader(path: os.PathLike[str] | str, mode: str = "r") -> Any:
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = make_reader(path, mode)  # type: ignore[arg-type]
            return readers[key]

        gguf.GGUFReader = reader  # type: ignore[misc,assignment]
        gguf.get_tensor_name_map = functools.cache(make_name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_name_map  # type: ignore[misc]
