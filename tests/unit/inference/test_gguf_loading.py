"""A GGUF file is parsed once per load, and the gguf module is left as it was afterwards."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from services.inference.gguf_loading import gguf_read_once


def write_gguf(path: Path, name: str) -> Path:
    """A small valid GGUF file: one string field, no tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def field_text(reader: gguf.GGUFReader, key: str) -> str:
    field = reader.fields[key]
    return bytes(field.parts[field.data[0]]).decode()


def test_inside_a_load_each_file_is_read_once_and_keeps_its_own_contents(tmp_path: Path) -> None:
    first = write_gguf(tmp_path / "first.gguf", "first model")
    second = write_gguf(tmp_path / "second.gguf", "second model")
    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    with gguf_read_once(first):
        # transformers imports the names at call time, as here.
        from gguf import GGUFReader, get_tensor_name_map

        config_read, tokenizer_read, other = GGUFReader(first), GGUFReader(str(first)), GGUFReader(second)
        maps = [get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) for _ in range(3)]

    assert config_read is tokenizer_read, "the same file was parsed twice"
    assert other is not config_read
    assert field_text(config_read, "general.name") == "first model"
    assert field_text(other, "general.name") == "second model"
    assert maps[0] is maps[1] is maps[2]
    assert maps[0].get_name("model.layers.29.self_attn.q_proj") == "blk.29.attn_q"
    # Outside a load the module is untouched: a new reader each time.
    assert gguf.GGUFReader is original_reader and gguf.get_tensor_name_map is original_name_map
    assert gguf.GGUFReader(first) is not gguf.GGUFReader(first)


def test_a_failed_load_leaves_the_gguf_module_as_it_was(tmp_path: Path) -> None:
    original_reader = gguf.GGUFReader
    missing = tmp_path / "missing.gguf"
    with pytest.raises(FileNotFoundError), gguf_read_once(missing):
        gguf.GGUFReader(missing)
    assert gguf.GGUFReader is original_reader
