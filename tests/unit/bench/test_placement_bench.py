"""The placement benchmark's workload and figures, without servers."""

from __future__ import annotations

from collections import Counter

from bench.placement_workload import Result, load_at_placement, ratios, summarize, workload


def test_the_workload_is_seeded_skewed_and_shares_one_prefix_per_group() -> None:
    a = workload(200, groups=8, prefix_tokens=600, rate=2.0, seed=3)
    assert a == workload(200, groups=8, prefix_tokens=600, rate=2.0, seed=3)
    assert [r.at_s for r in a] == sorted(r.at_s for r in a)
    by_group = {r.group: r.system for r in a}
    assert all(r.system == by_group[r.group] for r in a)  # one prefix per group
    assert len(set(by_group.values())) == len(by_group)
    assert all(550 <= len(text.split()) <= 650 for text in by_group.values())
    counts = Counter(r.group for r in a)
    assert counts[0] > counts[7]  # Zipf: the first group is the popular one
    assert 200 / 2.0 * 0.7 < a[-1].at_s < 200 / 2.0 * 1.3  # Poisson at the rate


def test_loads_are_counted_at_placement_against_the_bound() -> None:
    # Five overlapping requests on one replica, none elsewhere: the fifth is over max(4, ⌈1.5·5/3⌉).
    piled = [Result(True, started_s=i * 0.1, ended_s=10.0, replica="a") for i in range(5)]
    assert load_at_placement(piled, replicas=3, epsilon=0.5, floor=4) == (5, 1)
    spread = [Result(True, started_s=i * 0.1, ended_s=10.0, replica="abc"[i % 3]) for i in range(6)]
    assert load_at_placement(spread, replicas=3, epsilon=0.5, floor=4) == (2, 0)


def test_the_summary_reports_cache_share_and_the_prefix_over_wrt_ratios() -> None:
    results = [
        Result(True, 0.0, 2.0, ttft_s=0.5, replica="a", prompt_tokens=1000, cached_prompt_tokens=960),
        Result(True, 1.0, 4.0, ttft_s=1.5, replica="b", prompt_tokens=1000, cached_prompt_tokens=0),
        Result(False, error="UNAVAILABLE: down"),
    ]
    row = summarize(results, ["a", "b", "c"], epsilon=0.5, floor=4)
    assert row["failed"] == 1 and row["cached_prompt_share"] == 0.48
    assert row["replica_share"] == {"a": 0.5, "b": 0.5, "c": 0.0}
    assert row["requests_per_s"] == 0.5 and "UNAVAILABLE" in str(row["errors"])
    fast = {"ttft_ms_p90": 100.0, "requests_per_s": 3.0}
    slow = {"ttft_ms_p90": 400.0, "requests_per_s": 2.0}
    assert ratios(fast, slow) == {"ttft_p90_prefix_over_wrt": 0.25, "throughput_prefix_over_wrt": 1.5}  # type: ignore[arg-type]
