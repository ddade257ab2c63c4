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


PASSWORD = "MilvusPW123"


def _search_error(stub: retriever_pb2_grpc.RetrieverStub) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Search(pb.SearchRequest(query="When are spring tides?"), metadata=META, timeout=60)
    return caught.value


def test_credentials_in_the_uri_never_reach_a_caller_or_the_log(milvus: MilvusServerProcess) -> None:
    """pymilvus takes user:password from the URI, and "Milvus at <URI> is unreachable" is what the
    router hands to tenants (SearchDocuments, RAG turns' degraded reasons, /v1/embeddings) and what
    start-up logs every few seconds: the password must be in neither."""
    uri = f"http://root:{PASSWORD}@127.0.0.1:{milvus.port}"
    retriever = ServiceProcess("services.retriever", ["--milvus-uri", uri, "--milvus-timeout-seconds", "2"])
    try:
        retriever.start(wait_serving=False)
        deadline = time.monotonic() + 120
        while sum("unreachable" in line for line in retriever.lines) < 2:  # two retries logged
            assert time.monotonic() < deadline, retriever.output()
            time.sleep(0.2)
        with grpc.insecure_channel(retriever.address) as channel:
            error = _search_error(retriever_pb2_grpc.RetrieverStub(channel))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        details = error.details() or ""
        assert f"Milvus at http://root:***@127.0.0.1:{milvus.port} is unreachable" in details
        assert PASSWORD not in details
        # Masking changes only what is printed: pymilvus still gets the credentials.
        milvus.start()
        retriever.wait_serving(60)
        assert retriever.stop() == 0, retriever.output()
        assert PASSWORD not in "\n".join(retriever.lines)
    finally:
        retriever.stop()


def test_health_follows_milvus_after_start_up(milvus: MilvusServerProcess) -> None:
    """Once SERVING, a retriever whose Milvus goes away says NOT_SERVING (readiness takes it out
    of the Service; docs/operations.md, "Draining") and SERVING again when Milvus is back, with one
    log line each way. The token comes from the environment, as a Kubernetes Secret gives it."""
    milvus.start()
    retriever = ServiceProcess(
        "services.retriever",
        [
            "--milvus-uri", f"http://127.0.0.1:{milvus.port}",
            "--milvus-timeout-seconds", "2",
            "--milvus-check-seconds", "0.5",
        ],
        env={"LLMMESH_MILVUS_TOKEN": f"root:{PASSWORD}"},
    )  # fmt: skip
    try:
        retriever.start()
        with grpc.insecure_channel(retriever.address) as channel:
            stub = retriever_pb2_grpc.RetrieverStub(channel)
            header = pb.DocumentHeader(document_id="tides.txt", mime_type="text/plain")
            data = b"Spring tides happen at new and full moon, when the sun and moon pull together."
            stub.Ingest(
                iter([pb.IngestRequest(header=header), pb.IngestRequest(data=data)]),
                metadata=META,
                timeout=60,
            )

            milvus.kill()
            deadline = time.monotonic() + 20
            while retriever.health() != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "still SERVING without Milvus:\n" + retriever.output()
                time.sleep(0.2)
            assert retriever.health("llmmesh.v1.Retriever") == health_pb2.HealthCheckResponse.NOT_SERVING
            # Six more failed checks while Milvus stays away: health holds, and nothing more is logged.
            quiet_from = len(retriever.lines)
            time.sleep(3)
            assert retriever.health() == health_pb2.HealthCheckResponse.NOT_SERVING
            assert retriever.lines[quiet_from:] == []
            assert _search_error(stub).code() == grpc.StatusCode.UNAVAILABLE

            milvus.start()
            deadline = time.monotonic() + 60
            while retriever.health() != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "not SERVING with Milvus back:\n" + retriever.output()
                time.sleep(0.2)
            hits = stub.Search(
                pb.SearchRequest(query="When are spring tides?"), metadata=META, timeout=30
            ).chunks
            assert [c.document_id for c in hits] == ["tides.txt"]
        assert retriever.stop() == 0, "SIGTERM must stop the watcher and exit cleanly:\n" + retriever.output()
        output = "\n".join(retriever.lines)
        assert sum("reporting NOT_SERVING" in line for line in retriever.lines) == 1, output
        assert sum("reporting SERVING" in line for line in retriever.lines) == 1, output
        assert PASSWORD not in output
    finally:
        retriever.stop()
