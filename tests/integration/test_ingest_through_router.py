"""`llm-mesh ingest` with API keys on, in the secure setup: the router checks the key and dials the
retriever over mutual TLS; the retriever refuses anyone without the router's client certificate.

The tenant's documents are visible to it and invisible to others; a caller with no key is refused
before anything is stored; a direct caller at the retriever's port cannot get in, whatever tenant
its metadata claims.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common.metadata import TENANT_KEY
from services.gen.llmmesh.v1 import retriever_pb2, retriever_pb2_grpc, router_pb2_grpc
from services.launcher.readiness import wait_serving
from tests.support.certs import CertPaths, make_certs
from tests.support.document_router import DocumentRouter, document_router
from tests.support.processes import ServiceProcess

ACME_PLAN = "The acme launch code word is heliotrope. The launch is on a Tuesday."
GLOBEX_PLAN = "The globex launch code word is marigold. The launch is on a Friday."


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return make_certs(Path(tmp_path_factory.mktemp("certs")))


def mtls_credentials(certs: CertPaths) -> grpc.ChannelCredentials:
    """What the router holds: the mesh CA, and a client certificate it signed."""
    return grpc.ssl_channel_credentials(
        root_certificates=certs.ca.read_bytes(),
        private_key=certs.client_key.read_bytes(),
        certificate_chain=certs.client_cert.read_bytes(),
    )


def wait_serving_over_mtls(address: str, certs: CertPaths, timeout: float = 300) -> None:
    """The test helper's health check speaks plaintext, which this retriever refuses."""
    serving = wait_serving(
        address, time.monotonic() + timeout, poll_s=0.5, check_timeout=5, credentials=mtls_credentials(certs)
    )
    assert serving, f"retriever at {address} never SERVING over mTLS"


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory, certs: CertPaths) -> Iterator[ServiceProcess]:
    """The retriever as deployed securely: mTLS, client certificates from the mesh CA required."""
    data = Path(tmp_path_factory.mktemp("retriever"))
    service = ServiceProcess(
        "services.retriever",
        [
            "--milvus-uri", str(data / "milvus.db"), "--log-level", "WARNING",
            "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
            "--tls-client-ca", str(certs.ca),
        ],
    )  # fmt: skip
    try:
        service.start(wait_serving=False, timeout=300)
        wait_serving_over_mtls(f"localhost:{service.port}", certs)
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def router(
    retriever: ServiceProcess, certs: CertPaths, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DocumentRouter]:
    """API keys on, one per tenant; the retriever dialled with the router's client certificate."""
    tls = [
        "--retriever-tls-ca", str(certs.ca),
        "--retriever-tls-cert", str(certs.client_cert), "--retriever-tls-key", str(certs.client_key),
    ]  # fmt: skip
    keys_dir = Path(tmp_path_factory.mktemp("keys"))
    # `localhost`: the name the retriever's certificate was issued for.
    with document_router(f"localhost:{retriever.port}", keys_dir, ["acme", "globex"], tls) as door:
        yield door


@pytest.fixture(scope="module")
def plans(router: DocumentRouter, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each tenant ingests its own plan.txt, same document id, through `llm-mesh ingest`;
    acme passes --api-key, globex sets LLMMESH_API_KEY. Returns each run's stdout."""
    outputs = {}
    for tenant, text in (("acme", ACME_PLAN), ("globex", GLOBEX_PLAN)):
        folder = Path(tmp_path_factory.mktemp(tenant))
        (folder / "plan.txt").write_text(text)
        if tenant == "acme":
            result = router.ingest(str(folder), tenant="acme")
        else:
            env = {**os.environ, "LLMMESH_API_KEY": router.keys["globex"]}
            result = router.ingest(str(folder), env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        outputs[tenant] = result.stdout
    return outputs


def search(router: DocumentRouter, tenant: str, query: str) -> list[retriever_pb2.RetrievedChunk]:
    with grpc.insecure_channel(router.address) as channel:
        found = router_pb2_grpc.RouterStub(channel).SearchDocuments(
            retriever_pb2.SearchRequest(query=query, top_k=10), metadata=router.auth(tenant), timeout=60
        )
    return list(found.chunks)


def listed(router: DocumentRouter, tenant: str) -> list[retriever_pb2.DocumentInfo]:
    with grpc.insecure_channel(router.address) as channel:
        response = router_pb2_grpc.RouterStub(channel).ListDocuments(
            retriever_pb2.ListDocumentsRequest(), metadata=router.auth(tenant), timeout=30
        )
    return list(response.documents)


def test_ingested_documents_belong_to_the_keys_tenant_and_no_other(
    router: DocumentRouter, plans: dict[str, str]
) -> None:
    assert all("ingested 1 documents (0 unchanged)" in out for out in plans.values()), plans
    for tenant, own, other in (("acme", "heliotrope", "marigold"), ("globex", "marigold", "heliotrope")):
        assert [d.document_id for d in listed(router, tenant)] == ["plan.txt"]
        texts = " ".join(c.text for c in search(router, tenant, "What is the launch code word?"))
        assert own in texts, f"{tenant} cannot find its own document"
        assert other not in texts, f"{tenant} sees the other tenant's document"


@pytest.mark.parametrize(
    ("api_key", "message"),
    [(None, "missing API key"), ("llmk_made-up", "invalid API key")],
    ids=["no-key", "unknown-key"],
)
def test_ingest_without_a_valid_key_is_unauthenticated_and_stores_nothing(
    router: DocumentRouter, plans: dict[str, str], tmp_path: Path, api_key: str | None, message: str
) -> None:
    (tmp_path / "intruder.txt").write_text("Written by someone with no key.")
    # The shell's LLMMESH_API_KEY must not stand in for the missing key.
    env = {k: v for k, v in os.environ.items() if k != "LLMMESH_API_KEY"}
    args = [str(tmp_path)] + (["--api-key", api_key] if api_key else [])
    result = router.ingest(*args, env=env, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"UNAUTHENTICATED: {message}" in result.stderr
    assert "pass --api-key or set LLMMESH_API_KEY" in result.stderr
    assert "ingested" not in result.stdout
    for tenant in ("acme", "globex"):
        assert [d.document_id for d in listed(router, tenant)] == ["plan.txt"]


def direct_list(channel: grpc.Channel, tenant: str) -> retriever_pb2.ListDocumentsResponse:
    stub = retriever_pb2_grpc.RetrieverStub(channel)
    response: retriever_pb2.ListDocumentsResponse = stub.ListDocuments(
        retriever_pb2.ListDocumentsRequest(), metadata=((TENANT_KEY, tenant),), timeout=10
    )
    return response


def direct_ingest(channel: grpc.Channel, tenant: str) -> retriever_pb2.IngestSummary:
    header = retriever_pb2.DocumentHeader(document_id="plan.txt", mime_type="text/plain")
    requests = [retriever_pb2.IngestRequest(header=header), retriever_pb2.IngestRequest(data=b"overwritten")]
    summary: retriever_pb2.IngestSummary = retriever_pb2_grpc.RetrieverStub(channel).Ingest(
        iter(requests), metadata=((TENANT_KEY, tenant),), timeout=10
    )
    return summary


def test_the_retriever_port_refuses_a_direct_caller_without_the_routers_certificate(
    retriever: ServiceProcess, router: DocumentRouter, plans: dict[str, str], certs: CertPaths
) -> None:
    address = f"localhost:{retriever.port}"
    without_certificate = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
    for channel in (grpc.insecure_channel(address), grpc.secure_channel(address, without_certificate)):
        with channel:
            # Claiming a tenant in metadata gets a direct caller nowhere: the handshake fails first.
            for call in (direct_list, direct_ingest):
                with pytest.raises(grpc.RpcError) as refused:
                    call(channel, "acme")
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
    # acme's document is as the router stored it.
    assert "heliotrope" in " ".join(c.text for c in search(router, "acme", "launch code word"))
    # The router's certificate is what lets it through (the retriever then trusts its tenant).
    with grpc.secure_channel(address, mtls_credentials(certs)) as channel:
        assert [d.document_id for d in direct_list(channel, "acme").documents] == ["plan.txt"]
