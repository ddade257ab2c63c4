"""The retriever reads its own writes and never hangs on a dead Milvus (reliability matrix row 14).

Milvus runs as Milvus Lite's standalone server behind the fault proxy, so the
test can blackhole it (connections accepted, nothing answered: the hardest
outage to notice) and then bring it back.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.gen.llmmesh.v1 import retriever_pb2, retriever_pb2_grpc
from services.launcher.readiness import free_port, wait_port
from tests.reliability.mesh_support import running, sized
from tests.support.proxy import FaultProxy

TENANT = (("x-llmmesh-tenant", "acme"),)
MILVUS_TIMEOUT_S = 2
CLIENT_TIMEOUT_S = 20
TOPICS = ["volcanoes", "glaciers", "lighthouses", "beekeeping", "typography", "saxophones", "orchids"]


@pytest.fixture(scope="module")
def milvus_behind_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultProxy]:
    port = free_port()
    data = Path(tmp_path_factory.mktemp("milvus"))
    cmd = [sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(data), "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        started = wait_port(
            "127.0.0.1", port, time.monotonic() + 60, lambda: server.poll() is None, poll_s=0.2
        )
        assert started, "milvus_lite server did not start"
        with FaultProxy(f"127.0.0.1:{port}") as proxy:
            yield proxy
    finally:
        server.kill()
        server.wait(10)


@pytest.fixture(scope="module")
def retriever(milvus_behind_proxy: FaultProxy) -> Iterator[retriever_pb2_grpc.RetrieverStub]:
    args = [
        "--milvus-uri", f"http://{milvus_behind_proxy.address}",
        "--milvus-timeout-seconds", str(MILVUS_TIMEOUT_S), "--log-level", "WARNING",
    ]  # fmt: skip
    with (
        running("services.retriever", args) as proc,
        grpc.insecure_channel(proc.address) as channel,
    ):
        yield retriever_pb2_grpc.RetrieverStub(channel)


def ingest(
    stub: retriever_pb2_grpc.RetrieverStub, document_id: str, text: str, **metadata: str
) -> retriever_pb2.IngestSummary:
    header = retriever_pb2.DocumentHeader(document_id=document_id, mime_type="text/plain", metadata=metadata)
    requests = [retriever_pb2.IngestRequest(header=header), retriever_pb2.IngestRequest(data=text.encode())]
    summary: retriever_pb2.IngestSummary = stub.Ingest(iter(requests), metadata=TENANT, timeout=60)
    return summary


def test_a_search_right_after_an_ingest_finds_the_new_document(
    retriever: retriever_pb2_grpc.RetrieverStub,
) -> None:
    rounds = sized(len(TOPICS), len(TOPICS) * 4)
    for i in range(rounds):
        topic = TOPICS[i % len(TOPICS)]
        document_id = f"note-{i}-{topic}"
        # Topics repeat at full size, so earlier notes could fill the top 3 with the same text: a
        # marker only this round's note carries, and a filter on it, leave one right answer.
        marker = f"round{i}marker"
        text = f"All about {topic}. This note ({marker}) explains {topic} in detail, and only {topic}."
        assert ingest(retriever, document_id, text, round=marker).chunks >= 1
        # No sleep, no flush: the very next call must see the write.
        request = retriever_pb2.SearchRequest(
            query=f"Tell me about {topic} {marker}", top_k=3, metadata_filter={"round": marker}
        )
        hits = retriever.Search(request, metadata=TENANT, timeout=30).chunks
        assert [h.document_id for h in hits] == [document_id], f"round {i}: own write not visible: {hits}"
        listed = retriever.ListDocuments(retriever_pb2.ListDocumentsRequest(), metadata=TENANT, timeout=30)
        assert document_id in {d.document_id for d in listed.documents}


def test_a_blackholed_milvus_gives_unavailable_in_bounded_time_then_recovers(
    retriever: retriever_pb2_grpc.RetrieverStub, milvus_behind_proxy: FaultProxy
) -> None:
    ingest(retriever, "before-outage", "Tidal pools hold small crabs and anemones.")
    milvus_behind_proxy.blackhole = True
    try:
        for rpc, request in [
            ("Search", retriever_pb2.SearchRequest(query="crabs in tidal pools")),
            ("ListDocuments", retriever_pb2.ListDocumentsRequest()),
        ]:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                getattr(retriever, rpc)(request, metadata=TENANT, timeout=CLIENT_TIMEOUT_S)
            took = time.monotonic() - started
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, (rpc, caught.value.details())
            # Bounded by the Milvus timeout (plus a retry), far below the client's own deadline.
            assert took < 6 * MILVUS_TIMEOUT_S, f"{rpc} took {took:.1f} s to fail"
    finally:
        milvus_behind_proxy.blackhole = False
    deadline = time.monotonic() + 30
    while True:
        try:
            hits = retriever.Search(
                retriever_pb2.SearchRequest(query="crabs in tidal pools"), metadata=TENANT, timeout=10
            ).chunks
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the retriever did not recover after Milvus came back"
            time.sleep(0.5)
    assert "before-outage" in [h.document_id for h in hits]
