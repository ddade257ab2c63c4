"""The serving benchmark's parts: the workload every server gets, the summary and the verdict."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

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


def test_no_two_seeds_share_a_prompt_prefix_beyond_the_label_bracket() -> None:
    # Rounds send seeds 0, 1, 2 to servers that keep their prefix caches: a prompt must
    # differ from every earlier round's within its first few characters.
    seen: set[str] = set()
    for seed in range(4):
        heads = {r.prompt[:8] for r in workload(48, rate=4.0, seed=seed)}
        assert not heads & seen
        seen |= heads


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


def _row(server: str, tok_s: float, ttft: float) -> dict[str, Any]:
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
    assert verdict["goal_reachable"] is True  # all at once: no arrival bound
    assert verdict["vs_each"] == {"transformers": 5.0, "llama_cpp": 2.5, "llama_cpp_q4": 1.11}


def test_the_verdict_says_when_the_arrivals_put_the_goal_out_of_every_servers_reach() -> None:
    from bench.serving import ratios_over_rounds

    def paced(bound: float, mesh: float) -> list[dict[str, Any]]:
        return [
            {**_row("llm_mesh", mesh, 100.0), "arrival_bound_output_tokens_per_s": bound},
            _row("transformers", 108.0, 400.0),
        ]

    # 2 × 108 = 216 tok/s: a workload whose last request is sent too late for that bounds everyone.
    assert ratios(paced(212.0, 188.0))["goal_reachable"] is False
    assert ratios(paced(364.0, 231.0))["goal_reachable"] is True
    over = ratios_over_rounds([paced(364.0, 231.0), paced(212.0, 188.0), paced(300.0, 215.0)])
    assert over["rounds_goal_reachable"] == 2
    assert [r["goal_reachable"] for r in over["per_round"]] == [True, False, True]


def test_before_and_after_compares_with_the_baseline_checkout_which_is_no_peer() -> None:
    from bench.serving import BASELINE, versus_baseline, versus_baseline_over_rounds

    rows = [
        {**_row("llm_mesh", 120.0, 150.0), "itl_ms_p50": 40.0},
        {**_row(BASELINE, 100.0, 300.0), "itl_ms_p50": 80.0},
        _row("transformers", 60.0, 900.0),
    ]
    assert versus_baseline(rows) == {"tokens_per_s": 1.2, "ttft_p50_lower_by": 2.0, "itl_p50_lower_by": 2.0}
    verdict = ratios(rows)  # the peers' verdict never takes the baseline for a peer
    assert verdict["best_peer"] == "transformers" and verdict["vs_each"] == {"transformers": 2.0}
    assert versus_baseline(rows[:1]) == {}
    slower = [{**rows[0], "output_tokens_per_s": 90.0}, rows[1]]
    faster = [{**rows[0], "output_tokens_per_s": 150.0}, rows[1]]
    over = versus_baseline_over_rounds([rows, slower, faster])
    assert over["tokens_per_s"] == 1.2  # the median round, not the mean
    assert [r["tokens_per_s"] for r in over["per_round"]] == [1.2, 0.9, 1.5]


def test_the_baseline_runs_from_its_own_checkout_and_failing_to_start_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import argparse

    from bench import serving

    started: list[tuple[str, Path, list[str]]] = []

    def start_llm_mesh(dtype: str, extra: list[str], root: Path = Path(), name: str = "llm_mesh") -> str:
        started.append((name, root, extra))
        raise RuntimeError("exited with 1 before it was healthy")

    monkeypatch.setattr(serving, "start_llm_mesh", start_llm_mesh)
    args = argparse.Namespace(dtype="bfloat16", mesh_replica_args="--compile", baseline=tmp_path)
    with pytest.raises(RuntimeError, match="exited with 1"):
        serving.start(serving.BASELINE, args)
    assert started == [(serving.BASELINE, tmp_path, ["--compile"])]


def test_bench_serving_refuses_a_baseline_that_is_no_checkout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "services" / "inference").mkdir(parents=True)
    assert cli.main(["bench", "serving", "--baseline", str(tmp_path), "--no-front"]) == 2
    err = capsys.readouterr().err
    assert "services/router" in err and "services/gen" in err and "protogen" in err


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


class _FakeServer:
    """Records what the rounds do to it; ``log`` is shared by every server of a test."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.paused, self.stopped = name, log, False, False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def stop(self) -> None:
        self.stopped = True


def test_rounds_take_turns_with_every_other_server_paused_and_rotate_who_goes_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from bench import serving

    log: list[str] = []
    servers: dict[str, _FakeServer] = {}

    def start(name: str, args: argparse.Namespace) -> object:
        if name == "llama_cpp_q4":
            return {"server": name, "not_run": "SIGILL"}
        servers[name] = _FakeServer(name, log)
        return servers[name]

    tok_s = {"llm_mesh": [300.0, 200.0, 240.0], "transformers": [100.0, 120.0, 150.0]}

    seeds: list[int] = []

    def measure_on(
        server: _FakeServer, args: argparse.Namespace, count_tokens: object, seed: int
    ) -> dict[str, object]:
        # While one runs, every other started server is paused.
        assert not server.paused
        assert all(s.paused for s in servers.values() if s is not server)
        log.append(server.name)
        seeds.append(seed)
        return {**_row(server.name, tok_s[server.name].pop(0), 100.0), "ceiling_gflop_per_s": {"48": 1.0}}

    monkeypatch.setattr(serving, "start", start)
    monkeypatch.setattr(serving, "measure_on", measure_on)
    args = argparse.Namespace(rounds=3, seed=5)
    rounds = serving.measure_rounds(["llm_mesh", "transformers", "llama_cpp_q4"], args, len)
    assert log == ["llm_mesh", "transformers", "transformers", "llm_mesh", "llm_mesh", "transformers"]
    # Within a round every server gets the same workload; a round never repeats an earlier
    # round's prompts (a server started once would answer them from its prefix cache).
    assert seeds == [5, 5, 6, 6, 7, 7]
    assert all(s.stopped for s in servers.values())
    assert [[r["server"] for r in rows] for rows in rounds] == [
        ["llm_mesh", "transformers", "llama_cpp_q4"]
    ] * 3
    medians = serving.median_rows(rounds)
    assert medians[0]["output_tokens_per_s"] == 240.0
    assert medians[0]["rounds_output_tokens_per_s"] == [300.0, 200.0, 240.0]
    assert medians[2] == {"server": "llama_cpp_q4", "not_run": "SIGILL"}
    verdict = serving.ratios_over_rounds(rounds)
    # Per round 3.0, 1.67, 1.6: the verdict is their median, not the ratio of medians (2.0).
    assert [r["tokens_per_s_ratio"] for r in verdict["per_round"]] == [3.0, 1.67, 1.6]
    assert verdict["tokens_per_s_ratio"] == 1.67
    assert verdict["goal_met"] is False


def test_a_failing_round_still_stops_every_started_server(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from bench import serving

    servers: list[_FakeServer] = []

    def start(name: str, args: argparse.Namespace) -> _FakeServer:
        servers.append(_FakeServer(name, []))
        return servers[-1]

    def measure_on(
        server: _FakeServer, args: argparse.Namespace, count_tokens: object, seed: int
    ) -> dict[str, object]:
        raise RuntimeError("warm-up failed")

    monkeypatch.setattr(serving, "start", start)
    monkeypatch.setattr(serving, "measure_on", measure_on)
    with pytest.raises(RuntimeError, match="warm-up failed"):
        serving.measure_rounds(["llm_mesh", "transformers"], argparse.Namespace(rounds=2, seed=0), len)
    assert [s.stopped for s in servers] == [True, True]


def test_bench_serving_rejects_zero_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "serving", "--rounds", "0", "--no-front"]) == 2
    assert "--rounds" in capsys.readouterr().err


def test_a_paused_server_takes_no_cpu_and_answers_again_once_resumed(tmp_path: Path) -> None:
    import subprocess
    import sys

    import httpx
    import psutil

    from bench.serving_peers import RunningServer
    from services.launcher.readiness import free_port

    port = free_port()
    # A server that burns CPU in a thread while it serves /health.
    script = (
        "import http.server, threading\n"
        "def spin():\n"
        "    while True: pass\n"
        "threading.Thread(target=spin, daemon=True).start()\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
        "    def log_message(self, *a): pass\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], text=True)
    server = RunningServer("spinner", f"http://127.0.0.1:{port}", "m", procs=[proc])
    try:
        server.resume(timeout_s=30)  # not paused yet: waits until /health answers
        server.pause()
        process = psutil.Process(proc.pid)
        assert process.status() == psutil.STATUS_STOPPED
        before = sum(process.cpu_times()[:2])
        time.sleep(0.5)
        assert sum(process.cpu_times()[:2]) - before < 0.05  # a spinning thread, stopped
        with pytest.raises(httpx.TimeoutException):
            httpx.get(f"{server.base_url}/health", timeout=0.5)
        server.resume(timeout_s=30)
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
    finally:
        server.stop()
    assert proc.poll() is not None  # stop() ended it
