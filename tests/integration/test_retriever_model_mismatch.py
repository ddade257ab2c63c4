"""A retriever pointed at collections built by another embedding model refuses vector work clearly."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from services.common.metadata import TENANT_KEY
from services.gen.llmmesh.v1 import retriever_pb2 as pb
from services.gen.llmmesh.v1 import retriever_pb2_grpc
from services.retriever.store import MilvusStore
from tests.support.processes import ServiceProcess

META = ((TENANT_KEY, "acme"),)


def test_collections_from_another_model_give_failed_precondition(tmp_path: Path) -> None:
    uri = str(tmp_path / "milvus.db")
    # Collections as a retriever running another 384-dimensional model would have left them.
    MilvusStore(uri, "intfloat/e5-small-v2", 384).close()

    retriever = ServiceProcess("services.retriever", ["--milvus-uri", uri])
    try:
        retriever.start()
        with grpc.insecure_channel(retriever.address) as channel:
            stub = retriever_pb2_grpc.RetrieverStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Search(pb.SearchRequest(query="anything"), metadata=META, timeout=30)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = caught.value.details() or ""
            assert "intfloat/e5-small-v2" in details and "sentence-transformers/all-MiniLM-L6-v2" in details

            header = pb.DocumentHeader(document_id="a.txt", mime_type="text/plain")
            messages = iter([pb.IngestRequest(header=header), pb.IngestRequest(data=b"some text")])
            with pytest.raises(grpc.RpcError) as caught:
                stub.Ingest(messages, metadata=META, timeout=30)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # Nothing was written, and listing (no vectors involved) still works.
            assert (
                list(stub.ListDocuments(pb.ListDocumentsRequest(), metadata=META, timeout=30).documents) == []
            )
    finally:
        retriever.stop()
