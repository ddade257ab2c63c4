"""A replica given no model where ``--model`` points says so in one line, before loading anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.inference.model_loading import check_model_path
from tests.support.processes import ROOT


def test_a_model_is_a_directory_with_config_json_or_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    check_model_path(str(tmp_path / "model"))
    check_model_path(str(tmp_path / "m.gguf"))
    (tmp_path / "empty").mkdir()
    for path, why in (
        (tmp_path / "empty", "a directory without config.json"),  # an unmounted volume
        (tmp_path / "missing", "nothing there"),
        (tmp_path / "model" / "config.json", "not a .gguf file"),
    ):
        with pytest.raises(FileNotFoundError, match=f"^--model {path}: {why}"):
            check_model_path(str(path))
    # A hub id: nothing is downloaded at run time, so it is no model.
    with pytest.raises(FileNotFoundError, match="nothing there"):
        check_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_the_replica_refuses_a_missing_model_with_exit_2_and_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.inference", "--model", str(tmp_path / "gone"), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert f"error: --model {tmp_path / 'gone'}: nothing there" in done.stderr
    assert "Traceback" not in done.stderr
