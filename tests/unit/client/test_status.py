"""`llm-mesh status` piped into a script keeps every cell whole."""

from __future__ import annotations

import io

import pytest

from services.client import connection
from services.client.status import replica_table
from services.gen.llmmesh.v1 import inference_pb2, router_pb2


def test_a_piped_status_table_is_never_cut_to_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    piped = io.StringIO()  # not a terminal: what `llm-mesh status | grep …` writes to
    monkeypatch.setattr(connection.sys, "stdout", piped)
    address = "inference-replica-with-a-long-name-0.llm-mesh.svc.cluster.local:50061"
    reply = router_pb2.ListReplicasResponse(
        policy="weighted-response-time",
        replicas=[
            router_pb2.ReplicaStatus(
                address=address,
                model="SmolLM2-135M-Instruct",
                health=router_pb2.REPLICA_HEALTH_SERVING,
                ewma_ttft_ms=123.4,
                ewma_itl_ms=45.6,
                last_load=inference_pb2.LoadReport(
                    waiting=3, running=7, kv_blocks_used=100, kv_blocks_total=1024, tokens_per_second=177.7
                ),
            )
        ],
    )
    connection.output_console().print(replica_table(reply))
    table = piped.getvalue()
    assert "…" not in table
    row = next(line for line in table.splitlines() if address in line)
    for cell in ("serving", "177.7", "123", "46"):
        assert cell in row
    assert max(len(line) for line in table.splitlines()) > 80  # it took the width it needed
