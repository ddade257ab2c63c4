"""The serving benchmark's parts: the workload every server gets, the summary and the verdict."""

from __future__ import annotations

import itertools

import pytest

from bench.serving import linear_gflop_per_token, ratios
from bench.serving_client import OUTPUT_TOKENS, Outcome, ServingRequest, arrival_bound, summarize, workload
from services import cli


def test_every_server_gets_the_same_poisson_workload_of_distinct_prompts() -> None:
    first, again = workload(200, rate=4.0, seed=7), workload(200, rate=4.0, seed=7)
    assert first == again
    assert workload(200, rate=4.0, seed=8) != first
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(first)]
    assert all(g >= 0 for g in gaps)
    # Poisson at 4/s: mean gap 0.25 s (200 draws: well within ±30 %).
    assert 0.175 < sum(gaps) / len(gaps) < 0.325
    assert len({r.prompt for r in first}) == len(first), "no two requests share a prompt"
    assert {r.max_tokens for r in first} == set(OUTPUT_TOKENS)
    assert len({len(r.prompt) for r in first}) > 10, "prompt lengths are mixed"
    assert all(r.at_s == 0.0 for r in workload(10, rate=float("inf"), seed=0))


def test_summary_counts_tokens_over_the_span_to_the_last_token_and_reports_failures() -> None:
    outcomes = [
        Outcome(
            ok=True,
            ttft_s=0.1,
            latency_s=1.0,
            itl_s=[0.01, 0.03],
            completion_tokens=30,
            finished_at_s=2.0,
            prompt_tokens=100,
        ),
        Outcome(
            ok=True,
            ttft_s=0.3,
            latency_s=2.0,
            itl_s=[0.02],
            completion_tokens=50,
            finished_at_s=4.0,
            prompt_tokens=220,
        ),
        Outcome(ok=False, error="APIConnectionError: refused"),
    ]
    row = summarize(outcomes, wall_s=9.0)
    assert row["completion_tokens"] == 80
    assert row["output_tokens_per_s"] == 20.0  # 80 tokens over 4 s, not the 9 s wall
    assert row["processed_tokens_per_s"] == 100.0  # prompts count too: 400 tokens over 4 s
    assert row["failed"] == 1
    assert row["ttft_ms_p50"] == 200.0
    assert row["itl_ms_p50"] == 20.0
    assert "refused" in str(row["errors"])


def test_under_poisson_arrivals_no_server_passes_its_tokens_by_the_last_arrival() -> None:
    sent = [ServingRequest(at, "p", 32) for at in (0.0, 1.5, 4.0)]
    # 80 tokens can come no faster than by the time the last request is sent.
    assert arrival_bound(sent, 80) == 20.0
    assert arrival_bound(workload(10, rate=float("inf"), seed=0), 80) is None  # all at once: no bound
    last = max(r.at_s for r in workload(48, rate=4.0, seed=0))
    assert arrival_bound(workload(48, rate=4.0, seed=0), 3672) == pytest.approx(3672 / last)


def test_the_model_costs_two_flops_per_weight_per_token() -> None:
    # SmolLM2-135M: 134.5 M weights (tied embeddings counted once).
    assert linear_gflop_per_token() == pytest.approx(0.269, abs=0.001)


def _row(server: str, tok_s: float, ttft: float) -> dict[str, object]:
    return {"server": server, "output_tokens_per_s": tok_s, "ttft_ms_p50": ttft, "failed": 0}


def test_the_verdict_compares_with_the_best_peer_at_the_same_precision_only() -> None:
    rows = [
        _row("llm_mesh", 100.0, 500.0),
        _row("transformers", 20.0, 900.0),
        _row("llama_cpp", 40.0, 400.0),
        _row("llama_cpp_q4", 90.0, 100.0),  # 4-bit: a reference row, never "the better peer"
        {"server": "other", "not_run": "missing"},
    ]
    verdict = ratios(rows)
    assert verdict["best_peer"] == "llama_cpp"
    assert verdict["tokens_per_s_ratio"] == 2.5
    assert verdict["ttft_p50_ratio_peer_over_mesh"] == 0.8
    assert verdict["goal_met"] is False  # 2.5× the tokens, but a worse TTFT p50
    assert verdict["vs_each"] == {"transformers": 5.0, "llama_cpp": 2.5, "llama_cpp_q4": 1.11}


def test_bench_serving_rejects_an_unknown_server_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "serving", "--servers", "llm_mesh,vllm", "--no-front"]) == 2
    err = capsys.readouterr().err
    assert "vllm" in err and "transformers" in err and "llama_cpp" in err


def test_a_peer_that_dies_while_starting_is_reported_not_run_and_llm_mesh_failing_fails_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from bench import serving

    def crashed(dtype: str) -> None:
        raise RuntimeError("exited with -4 before it was healthy:\nlast log lines")

    monkeypatch.setitem(serving.STARTERS, "llama_cpp_q4", crashed)
    monkeypatch.setitem(serving.STARTERS, "llm_mesh", crashed)
    args = argparse.Namespace(dtype="bfloat16", mesh_replica_args="")
    row = serving.measure("llama_cpp_q4", args, count_tokens=len)
    assert row == {"server": "llama_cpp_q4", "not_run": "exited with -4 before it was healthy:"}
    with pytest.raises(RuntimeError, match="exited with -4"):
        serving.measure("llm_mesh", args, count_tokens=len)
