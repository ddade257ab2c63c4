"""The decode-slab benchmark at a tiny size: the slab holds long rows and answers as gathering does."""

from __future__ import annotations

import json
from pathlib import Path

from services import cli


def test_long_conversations_decode_from_the_slab_with_the_tokens_gathering_gives(
    model_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "slab.json"
    code = cli.main(
        ["bench", "decode-slab", "--model", str(model_path), "--rows", "2", "--prompt-tokens", "300",
         "--max-tokens", "4", "--rounds", "1", "--threads", "1", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    results = json.loads(out.read_text())
    assert results["slab_used"] is True
    assert results["tokens_identical"] is True
    assert set(results["median_decode_step_ms"]) == {"slab (1024 MiB)", "gather (0 MiB)"}
