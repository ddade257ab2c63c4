"""The benchmark's pure parts: workloads, statistics, the token check, targets and dispatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from bench import cli as bench_cli
from bench.engine import continuous_batching_sizes, parse_methods
from bench.report import check_tokens, ratios, targets
from bench.timings import MethodRun, RequestTiming, Summary, median_summary, percentile, summarize
from bench.workloads import UNIFORM_PROMPT, mixed, uniform
from services import cli


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> object:
    return AutoTokenizer.from_pretrained(str(model_path))


def _run(method: str, tokens: dict[str, list[int]], simulated: frozenset[str] = frozenset()) -> MethodRun:
    timings = {
        rid: RequestTiming(rid, arrival=0.0, first_token=0.5, finish=1.0, token_ids=ids)
        for rid, ids in tokens.items()
    }
    return MethodRun(method, timings, simulated=simulated)


def test_uniform_prompts_are_the_chat_template_over_the_robot_story(tokenizer: object) -> None:
    work = uniform(tokenizer, num_requests=3, max_tokens=64)  # type: ignore[arg-type]

    assert [r.max_tokens for r in work.requests] == [64, 64, 64]
    assert work.all_at_once
    text = tokenizer.decode(work.requests[2].prompt_token_ids)  # type: ignore[attr-defined]
    assert UNIFORM_PROMPT.format(i=2) in text
    assert text.rstrip().endswith("assistant")
    assert work.requests[0].prompt_token_ids != work.requests[1].prompt_token_ids


def test_mixed_workload_is_poisson_within_bounds_and_reproducible(tokenizer: object) -> None:
    work = mixed(tokenizer, 128, arrival_rate=4.0, seed=7)  # type: ignore[arg-type]
    again = mixed(tokenizer, 128, arrival_rate=4.0, seed=7)  # type: ignore[arg-type]
    other = mixed(tokenizer, 128, arrival_rate=4.0, seed=8)  # type: ignore[arg-type]

    arrivals = [r.arrival_s for r in work.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    # 128 exponential gaps at 4/s: the mean gap is 0.25 s, give or take sampling noise.
    assert 0.15 < arrivals[-1] / 128 < 0.4
    assert all(20 <= len(r.prompt_token_ids) <= 600 for r in work.requests)
    assert all(16 <= r.max_tokens <= 256 for r in work.requests)
    assert max(len(r.prompt_token_ids) for r in work.requests) > 400
    assert work == again
    assert work != other


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile([7.0], 95) == 7.0


def test_summary_counts_tokens_over_the_makespan() -> None:
    run = MethodRun(
        "m",
        {
            "a": RequestTiming("a", arrival=10.0, first_token=11.0, finish=12.0, token_ids=[1] * 30),
            "b": RequestTiming("b", arrival=11.0, first_token=11.5, finish=14.0, token_ids=[1] * 10),
        },
    )
    s = summarize(run)
    assert s.tok_s == pytest.approx(40 / 4.0)
    assert s.ttft_p50_s == pytest.approx(0.75)
    assert s.latency_p95_s == pytest.approx(2.0 + 0.95 * 1.0)


def test_median_over_rounds_ignores_one_slow_round() -> None:
    fast = Summary(300.0, 1.0, 2.0, 3.0, 4.0)
    slow = Summary(100.0, 3.0, 6.0, 9.0, 12.0)
    assert median_summary([fast, slow, fast]) == fast


def test_token_check_counts_mismatching_requests_and_skips_simulated_ones() -> None:
    mesh = _run("llm_mesh", {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9]})
    static = _run("hf_static", {"a": [1, 2, 3], "b": [4, 0, 6], "c": [7, 8, 9]})
    naive = _run("naive", {"a": [1, 2, 3], "b": [-1, -1, -1], "c": [7, 8, 9]}, simulated=frozenset({"b"}))

    check = check_tokens({"llm_mesh": mesh, "hf_static": static, "naive": naive})

    assert check.reference == "llm_mesh"
    assert check.mismatches == {"hf_static": 1, "naive": 0}
    assert check.compared == {"hf_static": 3, "naive": 2}
    assert check.first_divergence["hf_static"] == {"b": 1}


def test_targets_judge_uniform_throughput_and_mixed_ttft() -> None:
    results = {
        "llm_mesh": Summary(400.0, 1.0, 2.0, 5.0, 6.0),
        "hf_static": Summary(200.0, 4.0, 5.0, 9.0, 10.0),
        "hf_continuous": Summary(100.0, 5.0, 6.0, 20.0, 21.0),
    }
    table = ratios(results)
    assert table["hf_static"]["tok_s"] == 2.0
    assert table["hf_static"]["ttft_p50"] == 4.0

    uniform_verdicts = targets("uniform", table)
    assert uniform_verdicts["tok_s_vs_hf_static"]["met"] is True
    assert uniform_verdicts["tok_s_vs_hf_continuous"] == {"ratio": 4.0, "target": 3.0, "met": True}
    assert targets("mixed", table) == {"ttft_p50_vs_hf_static": {"ratio": 4.0, "target": 3.0, "met": True}}


def test_transformers_continuous_batching_gets_the_cpu_sizes_on_cpu_and_its_own_on_a_gpu() -> None:
    # On CPU the peer is configured as BENCHMARKS.md measured it; on a GPU a fixed 64
    # blocks would starve it of the batch a user of it would get.
    assert continuous_batching_sizes(None, "cpu") == (64, 2048)
    assert continuous_batching_sizes(None, "cuda") == (None, None)
    assert continuous_batching_sizes(512, "cuda") == (512, None)
    assert continuous_batching_sizes(128, "cpu") == (128, 2048)


def test_unknown_method_is_a_usage_error_naming_the_choices() -> None:
    assert parse_methods("hf_static,llm_mesh") == ["llm_mesh", "hf_static"]
    with pytest.raises(ValueError, match=r"unknown method.*hf_typo.*choose from"):
        parse_methods("llm_mesh,hf_typo")


def test_the_eager_engine_runs_beside_a_compiled_one_only_when_named() -> None:
    from bench.engine import DEFAULT_METHODS

    assert "llm_mesh_eager" not in DEFAULT_METHODS
    assert parse_methods("hf_static,llm_mesh_eager,llm_mesh") == ["llm_mesh", "llm_mesh_eager", "hf_static"]


def test_the_ceiling_counts_a_smollm2_token_as_its_linears_flops() -> None:
    from bench.matmul_ceiling import FLOPS_PER_TOKEN

    # 134.5 M multiply-adds: 30 layers of q, k, v, o, gate, up, down and the 49,152-row LM head.
    assert FLOPS_PER_TOKEN == 2 * (30 * 3_538_944 + 28_311_552)


def test_bench_dispatch_reports_a_missing_benchmark_clearly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(bench_cli.BENCHES, "router", ("bench.not_written_yet", "placeholder"))
    assert cli.main(["bench", "router"]) == 2
    assert "bench.not_written_yet is missing" in capsys.readouterr().err


def test_bench_engine_rejects_bad_only_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "engine", "--only", "llm_mesh,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_idle_box_reports_every_figure_for_every_gap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "idle.json"
    assert cli.main(["bench", "idle-box", "--rounds", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    figures = {"handoff_one_vcpu_us", "first_sha256_4k_us", "grpc_aio_write_ack_us"}
    if result["cpus"] > 1:
        figures.add("handoff_two_vcpus_us")
    assert set(result["p50_us_after_gap"]) == {"0ms", "1ms", "10ms"}
    for row in result["p50_us_after_gap"].values():
        assert set(row) == figures and all(v > 0 for v in row.values())
    # The table printed for the docs has a row per gap, each figure in its column.
    table = capsys.readouterr().out
    assert "| 10ms | " in table and "grpc aio write acknowledged" in table
    assert cli.main(["bench", "idle-box", "--rounds", "0"]) == 2


def test_a_relay_measured_in_its_own_pass_is_reported_beside_the_others() -> None:
    from bench.router import merge_passes

    first = {"overhead_paced": {"router": {"added_p50_ms": 1.0}}, "concurrency": {"ok": 1000}}
    second = {"overhead_paced": {"floor-go": {"added_p50_ms": 0.7}}, "throughput_unpaced": {"floor-go": {}}}
    merged = merge_passes(first, second)
    assert merged["overhead_paced"] == {"router": {"added_p50_ms": 1.0}, "floor-go": {"added_p50_ms": 0.7}}
    assert merged["concurrency"] == {"ok": 1000} and merged["throughput_unpaced"] == {"floor-go": {}}
    assert first["overhead_paced"] == {"router": {"added_p50_ms": 1.0}}  # the inputs are left as they were


def test_http_stack_bench_measures_every_stack_without_losing_events() -> None:
    import argparse
    import asyncio

    import uvloop

    from bench import http_stack

    # uvloop, as the router and the bench run: under plain asyncio a keep-alive request through
    # uvicorn waits ~44 ms for a delayed ACK, which would make this test slow, not wrong.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        results = runner.run(http_stack._run(argparse.Namespace(requests=20, streams=2, events=10)))
    assert {"uvicorn(h11)+starlette", "aiohttp"} <= set(results)
    for row in results.values():
        assert row["request_us"] > 0 and row["event_us"] > 0 and row["short_stream_us"] > 0


def test_one_steps_linears_are_the_same_flops_as_the_ceilings_token() -> None:
    from bench.matmul_ceiling import FLOPS_PER_TOKEN, LAYERS, LM_HEAD, SHAPES, STEP_SHAPES

    # The fused shapes the engine runs (q/k/v, gate/up) are the same multiply-adds as the
    # ceiling's separate ones, so "tokens/s" means the same thing for both figures.
    fused = 2 * (LAYERS * sum(k * n for k, n in STEP_SHAPES) + LM_HEAD[0] * LM_HEAD[1])
    assert fused == FLOPS_PER_TOKEN
    assert SHAPES[-1] == LM_HEAD


def test_the_ceiling_is_the_best_of_its_measurements_which_are_kept() -> None:
    from bench.matmul_ceiling import best_of

    slow = {
        "rows": 64,
        "gflops": 639.0,
        "tok_s": 2374.0,
        "step_linears_gflops": 685.0,
        "step_linears_tok_s": 2547.0,
    }
    fast = {
        "rows": 64,
        "gflops": 1104.0,
        "tok_s": 4103.0,
        "step_linears_gflops": 600.0,
        "step_linears_tok_s": 2230.0,
    }
    best = best_of([slow, fast])
    # A slow moment of the VM must not make the engine look closer to the limit than it is.
    assert (best["gflops"], best["tok_s"]) == (1104.0, 4103.0)
    assert (best["step_linears_gflops"], best["step_linears_tok_s"]) == (685.0, 2547.0)
    assert best["measurements"] == [slow, fast]


def test_decode_attention_bench_checks_each_kernel_against_the_reference(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every variant's output is compared with an fp32 reference that honours each row's length;
    one that reads past a row's length (here: SDPA without the mask) fails the run."""
    import argparse

    import torch.nn.functional as F

    from bench import decode_attention as bench

    def unmasked(x: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = x["q"].shape[0]
        q = x["q"].view(rows, bench.HEADS, 1, bench.HEAD_DIM)
        return F.scaled_dot_product_attention(q, x["keys"], x["values"], enable_gqa=True).reshape(
            x["q"].shape
        )

    eager = {"matmul": bench.engine_attention, "sdpa": bench.sdpa_attention}
    args = argparse.Namespace(
        rows=4, spans="16,24", dtype="float32", rounds=1, calls=1, threads=1, output=None
    )
    monkeypatch.setattr(bench, "variants", lambda: eager)
    assert bench.run(args) == 0
    assert "span 24, float32: matmul" in capsys.readouterr().out
    monkeypatch.setattr(bench, "variants", lambda: {**eager, "unmasked": unmasked})
    assert bench.run(args) == 1
    assert "WRONG: unmasked at span 16" in capsys.readouterr().out
