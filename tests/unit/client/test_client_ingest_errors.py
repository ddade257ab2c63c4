"""`ingest()` of a file that cannot be read raises the file's OSError, from the async client and the
sync one alike, not what gRPC makes of a failing request iterator (a bare CancelledError, or
UNKNOWN "Exception iterating requests!"). The router here is an in-process fake that reads the
whole request stream before it answers."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from llm_mesh_client import MeshClient, SyncMeshClient
from llm_mesh_client.pb import retriever_pb2, router_pb2_grpc


class IngestOnly(router_pb2_grpc.RouterServicer):
    def __init__(self) -> None:
        self.documents: list[tuple[str, int]] = []

    def IngestDocument(
        self, request_iterator: Iterator[retriever_pb2.IngestRequest], context: grpc.ServicerContext
    ) -> retriever_pb2.IngestSummary:
        header, size = None, 0
        for request in request_iterator:
            if request.HasField("header"):
                header = request.header
            else:
                size += len(request.data)
        assert header is not None
        self.documents.append((header.document_id, size))
        return retriever_pb2.IngestSummary(document_id=header.document_id, chunks=1)


@pytest.fixture(scope="module")
def fake_router() -> Iterator[tuple[str, IngestOnly]]:
    servicer = IngestOnly()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def unopenable_file(tmp_path: Path) -> Path:
    """A file whose open() fails with EACCES, as root too (who reads any mode-000 file)."""
    path = tmp_path / "secret.md"
    path.write_text("# secret\n")
    path.chmod(0)
    if os.access(path, os.R_OK):
        # Root: a name for a file even root cannot open for reading (write-only in procfs).
        path.unlink()
        path.symlink_to("/proc/sys/vm/drop_caches")
        if not path.is_file() or os.access(path, os.R_OK):
            pytest.skip(
                "not Linux: no procfs file (/proc/sys/vm/drop_caches) that even root cannot open for reading"
            )
    return path


def unreadable_file(tmp_path: Path) -> Path:
    """A file that opens, but whose read fails (EIO): the error comes from inside the call."""
    path = tmp_path / "mem.md"
    path.symlink_to("/proc/self/mem")
    if not path.is_file():
        pytest.skip("not Linux: no /proc/self/mem, the file that opens but fails to read (EIO)")
    return path


#: The two ways a file fails to be read: at open() (EACCES) and at read() (EIO); both clients.
UNREADABLE_FILES = pytest.mark.parametrize(
    ("make", "error_type", "code"),
    [(unopenable_file, PermissionError, errno.EACCES), (unreadable_file, OSError, errno.EIO)],
)


@UNREADABLE_FILES
async def test_an_unreadable_file_raises_its_os_error_naming_it_from_the_async_client(
    fake_router: tuple[str, IngestOnly],
    tmp_path: Path,
    make: Callable[[Path], Path],
    error_type: type[OSError],
    code: int,
) -> None:
    address, servicer = fake_router
    path = make(tmp_path)
    async with MeshClient(address) as client:
        with pytest.raises(error_type) as raised:
            await client.ingest(path)
        # The client is fine afterwards: the next document goes in.
        good = tmp_path / "good.md"
        good.write_text("# fine\n")
        summary = await client.ingest(good)
    assert raised.value.errno == code and raised.value.filename == str(path)
    assert summary.document_id == "good.md" and ("good.md", len("# fine\n")) in servicer.documents


@UNREADABLE_FILES
def test_an_unreadable_file_raises_its_os_error_naming_it_from_the_sync_client(
    fake_router: tuple[str, IngestOnly],
    tmp_path: Path,
    make: Callable[[Path], Path],
    error_type: type[OSError],
    code: int,
) -> None:
    address, _ = fake_router
    path = make(tmp_path)
    with SyncMeshClient(address) as client, pytest.raises(error_type) as raised:
        client.ingest(path)
    assert raised.value.errno == code and raised.value.filename == str(path)
