"""The retriever against a Milvus server over http:// (Milvus Lite's standalone server as a process).

Shows the other half of the one code path (a URL instead of a *.db file), that
health stays NOT_SERVING until Milvus is reachable, and that a Milvus outage
answers UNAVAILABLE quickly instead of hanging.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.common.metadata import TENANT_KEY
from services.gen.llmmesh.v1 import retriever_pb2 as pb
from services.gen.llmmesh.v1 import retriever_pb2_grpc
from services.launcher.readiness import free_port, wait_port
from tests.support.processes import ServiceProcess

META = ((TENANT_KEY, "acme"),)


class MilvusServerProcess:
    """`python -m milvus_lite server`: a standalone Milvus endpoint the test can kill."""

    def __init__(self, data_dir: Path, port: int) -> None:
        self.data_dir = data_dir
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "milvus_lite",
                "server",
                "--data-dir",
                str(self.data_dir),
                "--port",
                str(self.port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        proc = self.proc
        if wait_port(
            "127.0.0.1", self.port, time.monotonic() + timeout, lambda: proc.poll() is None, poll_s=0.2
        ):
            return
        if proc.poll() is not None:
            raise RuntimeError("milvus_lite server exited")
        raise TimeoutError("milvus_lite server did not listen")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture()
def milvus(tmp_path: Path) -> Iterator[MilvusServerProcess]:
    server = MilvusServerProcess(tmp_path / "milvus-data", free_port())
    yield server
    server.kill()


def test_health_waits_for_milvus_and_an_outage_is_unavailable_not_a_hang(milvus: MilvusServerProcess) -> None:
    retriever = ServiceProcess(
        "services.retriever",
        ["--milvus-uri", f"http://127.0.0.1:{milvus.port}", "--milvus-timeout-seconds", "2"],
    )
    try:
        retriever.start(wait_serving=False)
        with grpc.insecure_channel(retriever.address) as channel:
            stub = retriever_pb2_grpc.RetrieverStub(channel)
            # Milvus is not there yet: the model loads, then the service keeps retrying, NOT_SERVING.
            deadline = time.monotonic() + 120
            while not any("unreachable" in line for line in retriever.lines):
                assert time.monotonic() < deadline, retriever.output()
                time.sleep(0.2)
            assert retriever.health() == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as caught:
                stub.Search(pb.SearchRequest(query="anything"), metadata=META, timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "unreachable" in (caught.value.details() or "")

            milvus.start()
            retriever.wait_serving(60)
            header = pb.DocumentHeader(document_id="tides.txt", mime_type="text/plain")
            data = b"Spring tides happen at new and full moon, when the sun and moon pull together."
            summary = stub.Ingest(
                iter([pb.IngestRequest(header=header), pb.IngestRequest(data=data)]),
                metadata=META,
                timeout=60,
            )
            assert summary.chunks == 1
            hits = stub.Search(
                pb.SearchRequest(query="When are spring tides?"), metadata=META, timeout=30
            ).chunks
            assert [c.document_id for c in hits] == ["tides.txt"]

            milvus.kill()
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                stub.Search(pb.SearchRequest(query="When are spring tides?"), metadata=META, timeout=60)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "Milvus" in (caught.value.details() or "")
            assert time.monotonic() - started < 20
    finally:
        retriever.stop()
