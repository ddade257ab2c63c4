"""`llm-mesh status`: piped output keeps every cell whole; each replica's indexed prefix blocks."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

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


def test_the_table_shows_indexed_prefix_blocks_and_marks_approximate_ones() -> None:
    reply = router_pb2.ListReplicasResponse(
        policy="wrt",
        replicas=[
            router_pb2.ReplicaStatus(
                address="10.0.0.1:50052",
                indexed_blocks=1234,
                kv_events=True,
                last_load=inference_pb2.LoadReport(kv_blocks_total=4936),
            ),
            router_pb2.ReplicaStatus(address="10.0.0.2:50052", indexed_blocks=56, kv_events=False),
        ],
    )
    console = Console(record=True, width=200)
    console.print(replica_table(reply))
    text = console.export_text()
    assert "prefix blocks" in text
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if "10.0.0." in line}
    # Its share of the replica's KV cache; "~" marks approximate mode (no KV events).
    assert " 1234 (25.0%) " in rows["10.0.0.1:50052"] and "~" not in rows["10.0.0.1:50052"]
    assert " ~56 (–) " in rows["10.0.0.2:50052"]
