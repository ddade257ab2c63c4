"""``--policy prefix`` in a real router over three synthetic replicas (real gRPC, no model).

The router has no tokenizer yet, so requests carry no prefix blocks: the policy places by the
replicas' reported load, ties broken by a hash of each request, and honours session pins
within its load bound. The prefix scoring itself is unit-tested (tests/unit/router/placement).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from services.gen.llmmesh.v1 import router_pb2
from tests.support.processes import ServiceProcess
from tests.support.router_mesh import (
    expected_synthetic_ids,
    read_turn,
    router_process,
    router_stub,
    synthetic_replica,
    user_turn,
)


@pytest.fixture(scope="module")
def prefix_mesh() -> Iterator[tuple[ServiceProcess, list[ServiceProcess]]]:
    replicas = [synthetic_replica("--tokens-per-second", "1000") for _ in range(3)]
    router: ServiceProcess | None = None
    try:
        for r in replicas:
            r.start()
        router = router_process(replicas, "--policy", "prefix", "--prefix-epsilon", "0.5").start()
        yield router, replicas
    finally:
        for p in [router, *replicas]:
            if p is not None:
                p.stop()


def test_the_prefix_policy_serves_turns_and_spreads_requests_without_a_session(
    prefix_mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, replicas = prefix_mesh
    stub = router_stub(router)
    assert stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5).policy == "prefix"
    served: Counter[str] = Counter()
    for i in range(24):
        request = user_turn(f"question {i}", max_tokens=3)
        answer = read_turn(stub.ChatStream(request, timeout=10))
        assert answer.token_ids == expected_synthetic_ids(request)
        served[answer.end.replica] += 1
    # Idle replicas tie on cost; the hash of each request id breaks the tie, so all get some.
    assert set(served) == {r.address for r in replicas}
    assert max(served.values()) <= 16


def test_a_session_stays_on_its_replica_under_the_prefix_policy(
    prefix_mesh: tuple[ServiceProcess, list[ServiceProcess]],
) -> None:
    router, _ = prefix_mesh
    stub = router_stub(router)
    homes = {
        read_turn(stub.ChatStream(user_turn(f"turn {t}", 2, session_id="s-prefix"), timeout=10)).end.replica
        for t in range(8)
    }
    assert len(homes) == 1
