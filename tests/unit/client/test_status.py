"""`llm-mesh status`'s replica table: each replica's indexed prefix blocks and cache share, precise or approximate."""

from __future__ import annotations

from rich.console import Console

from services.client.status import replica_table
from services.gen.llmmesh.v1 import inference_pb2, router_pb2


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
