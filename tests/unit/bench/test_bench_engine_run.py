"""The engine benchmark end to end at a tiny size: JSON shape and fp32 token equality."""

from __future__ import annotations

import json
from pathlib import Path

from services import cli

SUMMARY_KEYS = {"tok_s", "ttft_p50_s", "ttft_p95_s", "latency_p50_s", "latency_p95_s"}


def test_tiny_uniform_run_writes_comparable_json_with_identical_fp32_tokens(
    model_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "engine.json"
    code = cli.main(
        [
            "bench",
            "engine",
            "--workload",
            "uniform",
            "--model",
            str(model_path),
            "--dtype",
            "float32",
            "--num-requests",
            "4",
            "--max-tokens",
            "4",
            "--only",
            "llm_mesh,hf_static",
            "--no-compile",
            "--rounds",
            "2",
            # One thread: on a shared 2-core box two spinning torch threads crawl.
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )

    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["workload"] == "uniform"
    assert doc["model"] == str(model_path)
    assert doc["device"] == "cpu"
    assert doc["dtype"] == "float32"
    assert set(doc["results"]) == {"llm_mesh", "hf_static"}
    for method, summary in doc["results"].items():
        assert set(summary) >= SUMMARY_KEYS, method
        assert summary["tok_s"] > 0
        assert 0 < summary["ttft_p50_s"] <= summary["ttft_p95_s"] <= summary["latency_p95_s"]
        assert summary["ttft_p50_s"] <= summary["latency_p50_s"]
    # Every request was compared token for token against llm_mesh, and none differ.
    assert doc["token_check"]["reference"] == "llm_mesh"
    assert doc["token_check"]["compared"] == {"hf_static": 4}
    assert doc["token_check"]["mismatches"] == {"hf_static": 0}
    assert doc["settings"]["total_tokens"] == 16
    # Two interleaved rounds, each timing both methods; the headline figures are their medians.
    assert doc["rounds"] == 2
    assert [set(r) for r in doc["per_round"]] == [{"llm_mesh", "hf_static"}] * 2
    assert doc["ratios"]["hf_static"]["tok_s"] > 0
    assert set(doc["targets"]) == {"tok_s_vs_hf_static"}


def test_isolate_times_each_method_in_its_own_process_and_still_compares_tokens(
    model_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "engine.json"
    argv = ["bench", "engine", "--workload", "uniform", "--model", str(model_path), "--num-requests", "4"]
    code = cli.main(
        [
            *argv,
            "--max-tokens",
            "4",
            "--only",
            "llm_mesh,hf_static",
            "--isolate",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )

    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["isolated"] is True
    assert set(doc["results"]) == {"llm_mesh", "hf_static"} and all(
        s["tok_s"] > 0 for s in doc["results"].values()
    )
    # The children's tokens came back whole: compared request by request, and equal in fp32.
    assert doc["token_check"]["compared"] == {"hf_static": 4}
    assert doc["token_check"]["mismatches"] == {"hf_static": 0}
