"""The load report's arithmetic (bench/load.py): contiguity, percentiles, error counts, RetryInfo."""

from __future__ import annotations

from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from bench.load import StreamOutcome, retry_delay_s, summarize, tokens_per_second_series


def outcome(code: str = "OK", positions: list[int] | None = None, latency: float = 1.0) -> StreamOutcome:
    positions = list(range(4)) if positions is None else positions
    times = [10.0 + 0.1 * i for i in range(len(positions))]
    return StreamOutcome(
        code=code,
        started=9.9,
        latency_s=latency,
        ttft_s=0.1 if positions else None,
        token_times=times,
        positions=positions,
        token_ids=[7] * len(positions),
    )


def test_a_gap_or_a_duplicate_breaks_contiguity() -> None:
    assert outcome(positions=[0, 1, 2, 3]).contiguous
    assert not outcome(positions=[0, 1, 3]).contiguous
    assert not outcome(positions=[0, 1, 1, 2]).contiguous
    assert not outcome(positions=[1, 2]).contiguous


def test_summary_counts_successes_errors_and_token_throughput() -> None:
    outcomes = [outcome(latency=1.0), outcome(latency=3.0), outcome("UNAVAILABLE", positions=[])]
    level = summarize("synthetic", "closed", 3, outcomes, wall_s=2.0)
    assert (level.requests, level.succeeded) == (3, 2)
    assert level.success_rate == round(2 / 3, 5)
    assert level.tokens_per_s == 4.0  # 8 tokens in 2 s, failed calls excluded
    assert level.errors == {"UNAVAILABLE": 1}
    assert level.latency_p50_ms == 2000.0
    assert level.itl_p50_ms == 100.0
    assert level.contiguous == 2


def test_tokens_per_second_series_bins_arrivals() -> None:
    xs, ys = tokens_per_second_series([outcome()], t0=10.0, bin_s=0.25)
    # Arrivals at 0.0, 0.1, 0.2, 0.3 s: three in the first quarter second, one in the second.
    assert xs == [0.0, 0.25]
    assert ys == [12.0, 4.0]


def test_retry_delay_is_read_from_the_rich_status() -> None:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=1, nanos=500_000_000)))
    status = status_pb2.Status(code=8, message="slow down", details=[detail])
    assert retry_delay_s((("grpc-status-details-bin", status.SerializeToString()),)) == 1.5
    assert retry_delay_s(()) is None
