"""Outlier ejection (backoff 30 s × n, never over half the pool), when a generation probe is due, and
model selection: pure logic, fake clock."""

from __future__ import annotations

import random

import pytest

from services.common import errors
from services.router.placement.health import ActiveHealthChecker
from services.router.placement.models import ModelCatalog
from services.router.placement.outliers import EjectionConfig, FailureKind, OutlierDetector, may_eject
from services.router.placement.policies import LatencyEwma
from services.router.placement.pool import ReplicaPool


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_consecutive_failures_eject_and_a_success_resets_the_streak() -> None:
    detector = OutlierDetector(EjectionConfig(consecutive_failures=3), FakeClock())
    assert not detector.record_failure(FailureKind.ERROR)
    detector.record_success()
    assert not detector.record_failure(FailureKind.STALL)
    assert not detector.record_failure(FailureKind.TTFT_TIMEOUT)
    assert detector.record_failure(FailureKind.ERROR)
    assert detector.last_failure is FailureKind.ERROR


def test_ejection_lasts_30s_times_the_number_of_ejections() -> None:
    clock = FakeClock()
    detector = OutlierDetector(EjectionConfig(consecutive_failures=1, base_ejection_s=30), clock)
    for n in (1, 2, 3):
        assert detector.record_failure(FailureKind.ERROR)
        assert detector.eject() == 30 * n
        assert detector.ejected
        clock.now += 30 * n - 0.1
        assert detector.ejected
        clock.now += 0.2
        assert not detector.ejected  # re-admitted after its backoff
    assert detector.ejection_count == 3


def test_never_more_than_half_the_pool_is_ejected() -> None:
    assert may_eject(0, 4, 0.5) and may_eject(1, 4, 0.5)
    assert not may_eject(2, 4, 0.5)
    assert not may_eject(0, 1, 0.5)  # a pool of one keeps its only replica
    assert may_eject(0, 2, 0.5) and not may_eject(1, 2, 0.5)


def test_an_ejection_lasts_at_most_max_ejection_s_and_a_healthy_replica_is_forgiven() -> None:
    """Without a cap a replica that failed now and then was out longer each time, without end
    (the 6th ejection: 180 s); failures while ejected also counted towards the next one."""
    clock = FakeClock()
    config = EjectionConfig(consecutive_failures=2, base_ejection_s=30, max_ejection_s=90)
    detector = OutlierDetector(config, clock)
    durations = []
    for _ in range(5):
        assert not detector.record_failure(FailureKind.ERROR)
        assert detector.record_failure(FailureKind.ERROR)
        durations.append(detector.eject())
        # Its streams that still end, and the health probes, fail while it is out: not counted.
        for _ in range(5):
            assert not detector.record_failure(FailureKind.ERROR)
        clock.now += durations[-1] + 0.1
        assert not detector.ejected and detector.consecutive_failures == 0
    assert durations == [30, 60, 90, 90, 90]
    # Healthy for a while: each base interval of successes lowers the next ejection's length.
    for _ in range(3):
        clock.now += 30.1
        detector.record_success()
    assert detector.record_failure(FailureKind.ERROR) is False
    assert detector.record_failure(FailureKind.ERROR)
    assert detector.eject() == 90  # 5 ejections, 3 forgiven: the 3rd's length


async def test_never_more_than_half_of_a_models_replicas_are_out_counting_those_not_serving() -> None:
    """Counted over the whole pool, both replicas of one model could be ejected while another
    model's kept the share low, and in a rolling deploy the last serving ones could go."""
    pool = ReplicaPool(lambda *_: None, ejection=EjectionConfig(consecutive_failures=1))  # type: ignore[arg-type]
    pool.set_addresses(["a1", "a2", "b1", "b2", "c1", "c2", "c3", "c4"])
    for address, replica in pool.replicas.items():
        replica.model, replica.serving = address[0], True
    pool.report_failure(pool.replicas["a1"], FailureKind.ERROR)
    pool.report_failure(pool.replicas["a2"], FailureKind.ERROR)
    assert [r.address for r in pool.candidates("a")] == ["a2"]
    pool.replicas["c1"].serving = pool.replicas["c2"].serving = False  # being redeployed
    pool.report_failure(pool.replicas["c3"], FailureKind.ERROR)
    assert sorted(r.address for r in pool.candidates("c")) == ["c3", "c4"]
    await pool.close()


def test_ejection_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="consecutive_failures"):
        EjectionConfig(consecutive_failures=0)


def test_aliases_resolve_and_fallbacks_follow_in_order() -> None:
    catalog = ModelCatalog.from_flags("fast=small,quality=big", "big:medium,medium:small")
    known = {"small", "medium", "big"}
    assert catalog.plan("fast", known) == ["small"]
    assert catalog.plan("quality", known) == ["big", "medium", "small"]
    assert catalog.plan("medium", known) == ["medium", "small"]


def test_default_model_is_the_only_one_or_the_configured_one() -> None:
    assert ModelCatalog().plan("", {"m"}) == ["m"]
    assert ModelCatalog(default_model="b").plan("", {"a", "b"}) == ["b"]


def test_canary_takes_its_share_of_requests() -> None:
    catalog = ModelCatalog.from_flags(canary="m=m-v2:0.1")
    catalog._rng = random.Random(4)
    picks = [catalog.plan("m", {"m", "m-v2"})[0] for _ in range(2000)]
    share = picks.count("m-v2") / len(picks)
    assert 0.07 < share < 0.13
    # The stable version stays the fallback of a canary request.
    assert catalog.plan("m", {"m", "m-v2"})[-1] == "m"


def test_unknown_model_names_the_field_and_empty_pool_is_unavailable() -> None:
    with pytest.raises(errors.InvalidArgument, match="model"):
        ModelCatalog().plan("nope", {"m"})
    with pytest.raises(errors.DependencyUnavailable):
        ModelCatalog().plan("m", set())


def test_bad_flags_are_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="--model-aliases"):
        ModelCatalog.from_flags(aliases="fast")
    with pytest.raises(ValueError, match="--canary"):
        ModelCatalog.from_flags(canary="m=m-v2:1.5")


class _ProbedReplica:
    """What ``probe_due`` reads of a replica: its last probe and its token-gap EWMA."""

    def __init__(self, clock: FakeClock) -> None:
        self.last_probe = 0.0
        self.itl = LatencyEwma(clock=clock)


def test_a_probe_waits_its_period_and_is_skipped_while_tokens_flow() -> None:
    clock = FakeClock()
    checker = ActiveHealthChecker(pool=None, probe_every_s=30.0)  # type: ignore[arg-type]
    replica = _ProbedReplica(clock)
    assert checker.probe_due(replica, clock.now)  # type: ignore[arg-type]  # never probed, no tokens
    replica.last_probe = clock.now
    clock.now += 29.0
    assert not checker.probe_due(replica, clock.now)  # type: ignore[arg-type]
    clock.now += 2.0
    replica.itl.observe(0.02)  # this router's turns are streaming tokens from it right now
    assert not checker.probe_due(replica, clock.now)  # type: ignore[arg-type]
    clock.now += 30.0  # then the tokens stop for a whole period: only a probe can tell
    assert checker.probe_due(replica, clock.now)  # type: ignore[arg-type]
    assert not ActiveHealthChecker(pool=None, probe_every_s=0).probe_due(replica, clock.now)  # type: ignore[arg-type]


async def test_a_replica_that_comes_back_serving_another_model_is_grouped_under_it() -> None:
    """A redeploy at the same address may serve another model: its model was asked once, so the
    new one's traffic kept going to a replica grouped under the old name."""
    import grpc
    from grpc_health.v1 import health_pb2

    from services.gen.llmmesh.v1 import inference_pb2

    class Down(grpc.aio.AioRpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())

    class Fake:
        def __init__(self) -> None:
            self.up, self.model = True, "smol-a"

        async def Check(self, request: object, timeout: float) -> health_pb2.HealthCheckResponse:
            if not self.up:
                raise Down()
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

        async def GetModelInfo(self, request: object, timeout: float) -> inference_pb2.ModelInfo:
            return inference_pb2.ModelInfo(model_id=self.model, kv_block_size=16)

        async def GetLoad(self, request: object, timeout: float) -> inference_pb2.LoadReport:
            return inference_pb2.LoadReport()

    pool = ReplicaPool(lambda *_: None)  # type: ignore[arg-type]
    pool.set_addresses(["10.0.0.1:50052"])
    (replica,) = pool.replicas.values()
    fake = Fake()
    replica.stub = replica.health_stub = fake  # type: ignore[assignment]
    checker = ActiveHealthChecker(pool, probe_every_s=0)
    await checker.check(replica)
    assert [r.address for r in pool.candidates("smol-a")] == ["10.0.0.1:50052"]
    fake.up = False  # redeployed: down for a moment, then up with another model
    await checker.check(replica)
    fake.up, fake.model = True, "smol-b"
    await checker.check(replica)
    assert pool.candidates("smol-a") == [] and len(pool.candidates("smol-b")) == 1
    await pool.close()
