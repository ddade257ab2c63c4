"""The router passes each downstream status on as the client should see it (issue #19).

Two halves:

* a table: a fake retriever on a loopback socket answers every call with the status
  the test injects, and each router RPC that forwards to it must hand the client the
  mapped status and the retriever's own message (docs/router.md, "Downstream statuses");
* the real retriever, rejecting uploads part-way (no header first; a document over its
  ``--max-document-bytes`` sent in 64 KiB pieces), 200 times through the router: every
  answer is INVALID_ARGUMENT naming the field, never INTERNAL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest

from services.common.metadata import TENANT_KEY
from services.gen.llmmesh.v1 import retriever_pb2 as pb
from services.gen.llmmesh.v1 import retriever_pb2_grpc, router_pb2_grpc
from tests.support.processes import ServiceProcess
from tests.support.router_mesh import router_process, synthetic_replica

PIECE = 64 * 1024
MAX_DOCUMENT_BYTES = 256 * 1024
EARLY_REJECTIONS = 200

#: What a client of the router sees for each status the retriever answers with.
MAPPING = {
    grpc.StatusCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
}


@dataclass
class FakeRetriever(retriever_pb2_grpc.RetrieverServicer):
    """Aborts every call with ``status``; Ingest reads one message first, then ends the call
    while the client is still sending (the early-rejection shape)."""

    status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    calls: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    received: list[pb.IngestRequest] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)

    def _abort(self, method: str, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.calls.append(method)
        context.abort(self.status, f"fake retriever: {method} says {self.status.name}")

    def Ingest(self, request_iterator: Iterator[pb.IngestRequest], context: grpc.ServicerContext) -> None:  # type: ignore[override]
        if self.status == grpc.StatusCode.OK:
            # No status to inject: read until the router's side ends, as a slow upload would.
            context.add_callback(self.ended.set)
            for message in request_iterator:
                self.received.append(message)
        next(request_iterator, None)
        self._abort("Ingest", context)

    def Search(self, request: pb.SearchRequest, context: grpc.ServicerContext) -> None:  # type: ignore[override]
        self._abort("Search", context)

    def DeleteDocument(self, request: pb.DeleteDocumentRequest, context: grpc.ServicerContext) -> None:  # type: ignore[override]
        self._abort("DeleteDocument", context)

    def ListDocuments(self, request: pb.ListDocumentsRequest, context: grpc.ServicerContext) -> None:  # type: ignore[override]
        self._abort("ListDocuments", context)


def upload(document_id: str, size: int, header: bool = True) -> Iterator[pb.IngestRequest]:
    """A document of ``size`` bytes in 64 KiB pieces, after its header unless ``header`` is False."""
    if header:
        yield pb.IngestRequest(header=pb.DocumentHeader(document_id=document_id, mime_type="text/plain"))
    for start in range(0, size, PIECE):
        yield pb.IngestRequest(data=b"x" * min(PIECE, size - start))


Call = Callable[[router_pb2_grpc.RouterStub], object]
#: Every router RPC that forwards to the retriever, and the retriever method it calls.
FORWARDED: dict[str, tuple[str, Call]] = {
    "IngestDocument": ("Ingest", lambda s: s.IngestDocument(upload("doc", 8 * PIECE), timeout=10)),
    "SearchDocuments": ("Search", lambda s: s.SearchDocuments(pb.SearchRequest(query="q"), timeout=10)),
    "DeleteDocument": (
        "DeleteDocument",
        lambda s: s.DeleteDocument(pb.DeleteDocumentRequest(document_id="doc"), timeout=10),
    ),
    "ListDocuments": ("ListDocuments", lambda s: s.ListDocuments(pb.ListDocumentsRequest(), timeout=10)),
}


@pytest.fixture(scope="module")
def replica() -> Iterator[ServiceProcess]:
    with synthetic_replica() as process:
        yield process


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeRetriever, str]]:
    servicer = FakeRetriever()  # type: ignore[abstract]  # the cache RPCs are not forwarded by the router
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    retriever_pb2_grpc.add_RetrieverServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def fake_router(
    replica: ServiceProcess, fake: tuple[FakeRetriever, str]
) -> Iterator[router_pb2_grpc.RouterStub]:
    with (
        router_process([replica], "--retriever-addr", fake[1]) as router,
        grpc.insecure_channel(router.address) as channel,
    ):
        yield router_pb2_grpc.RouterStub(channel)


@pytest.mark.parametrize("rpc", sorted(FORWARDED))
@pytest.mark.parametrize("injected", list(MAPPING), ids=lambda c: c.name)
def test_each_downstream_status_reaches_the_client_mapped(
    fake_router: router_pb2_grpc.RouterStub,
    fake: tuple[FakeRetriever, str],
    rpc: str,
    injected: grpc.StatusCode,
) -> None:
    servicer, _ = fake
    method, call = FORWARDED[rpc]
    servicer.status = injected
    before = len(servicer.calls)
    with pytest.raises(grpc.RpcError) as caught:
        call(fake_router)
    error: grpc.Call = caught.value  # type: ignore[assignment]
    assert servicer.calls[before:] == [method], "the router did not forward the call"
    assert (error.code(), error.details()) == (
        MAPPING[injected],
        f"fake retriever: {method} says {injected.name}",
    )


def test_a_client_giving_up_mid_upload_ends_the_retrievers_call(
    fake_router: router_pb2_grpc.RouterStub, fake: tuple[FakeRetriever, str]
) -> None:
    servicer, _ = fake
    servicer.status = grpc.StatusCode.OK
    servicer.received.clear()
    servicer.ended.clear()
    hold = threading.Event()

    def parts() -> Iterator[pb.IngestRequest]:
        yield from upload("slow", PIECE)
        hold.wait(30)  # the client stalls mid-upload, then cancels

    future = fake_router.IngestDocument.future(parts(), timeout=30)
    try:
        deadline = time.monotonic() + 10
        while len(servicer.received) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(servicer.received) == 2, "the router did not pass the pieces on as they came"
        assert not servicer.ended.is_set()
        future.cancel()
        assert servicer.ended.wait(5), "the retriever's call outlived the client's"
    finally:
        hold.set()


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    data = tmp_path_factory.mktemp("retriever")
    args = ["--milvus-uri", str(data / "milvus.db"), "--max-document-bytes", str(MAX_DOCUMENT_BYTES)]
    with ServiceProcess("services.retriever", [*args, "--metrics-port", "0"]) as process:
        yield process


@pytest.fixture(scope="module")
def router(replica: ServiceProcess, retriever: ServiceProcess) -> Iterator[router_pb2_grpc.RouterStub]:
    with (
        router_process([replica], "--retriever-addr", retriever.address) as process,
        grpc.insecure_channel(process.address) as channel,
    ):
        yield router_pb2_grpc.RouterStub(channel)


def rejection(
    ingest: Callable[..., object], parts: Iterator[pb.IngestRequest], **kwargs: object
) -> tuple[str, str]:
    """The (code, message) an upload got; ``ingest`` is the router's IngestDocument or the retriever's Ingest."""
    try:
        ingest(parts, timeout=30, **kwargs)
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""  # type: ignore[attr-defined]
    return "OK", ""


def test_uploads_rejected_part_way_are_invalid_argument_every_time(
    router: router_pb2_grpc.RouterStub, retriever: ServiceProcess
) -> None:
    # Called directly, the retriever names the field; through the router it must say the same.
    with grpc.insecure_channel(retriever.address) as channel:
        direct = retriever_pb2_grpc.RetrieverStub(channel)
        assert rejection(direct.Ingest, upload("d", PIECE, header=False), metadata=((TENANT_KEY, "t"),)) == (
            "INVALID_ARGUMENT",
            "header: the first message must be the document header",
        )
    expected = {
        "no header": ("INVALID_ARGUMENT", "header: the first message must be the document header"),
        "too large": ("INVALID_ARGUMENT", f"data: document exceeds the {MAX_DOCUMENT_BYTES}-byte limit"),
    }
    seen: dict[tuple[str, str, str], int] = {}
    for i in range(EARLY_REJECTIONS):
        case = "no header" if i % 2 else "too large"
        parts = upload(f"big-{i}", 3 * MAX_DOCUMENT_BYTES, header=case == "too large")
        key = (case, *rejection(router.IngestDocument, parts))
        seen[key] = seen.get(key, 0) + 1
    wrong = {key: n for key, n in seen.items() if key[1:] != expected[key[0]]}
    assert not wrong, f"{sum(wrong.values())} of {EARLY_REJECTIONS} answered otherwise: {wrong}"
    assert seen == {(case, *answer): EARLY_REJECTIONS // 2 for case, answer in expected.items()}


def test_an_upload_in_pieces_under_the_limit_goes_through(router: router_pb2_grpc.RouterStub) -> None:
    # The pump's ordinary path: every piece reaches the retriever, then the half-close.
    words = " ".join(f"lighthouse{i} keeper log entry" for i in range(900)).encode()
    parts = [pb.IngestRequest(header=pb.DocumentHeader(document_id="log", mime_type="text/plain"))]
    parts += [pb.IngestRequest(data=words[i : i + PIECE // 4]) for i in range(0, len(words), PIECE // 4)]
    assert len(parts) > 2
    summary = router.IngestDocument(iter(parts), timeout=120)
    assert (summary.document_id, summary.bytes) == ("log", len(words))
    assert summary.chunks >= 1
