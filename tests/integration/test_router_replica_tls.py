"""The router dials its replicas over mutual TLS when given --replica-tls-* flags (and checks every peer's TLS flags)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.certs import CertPaths, make_certs
from tests.support.processes import ServiceProcess

ROUTER_ARGS = ["--probe-interval-s", "0", "--health-interval-s", "0.5", "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return make_certs(Path(tmp_path_factory.mktemp("certs")))


@pytest.fixture(scope="module")
def mtls_replica(certs: CertPaths) -> Iterator[ServiceProcess]:
    """A synthetic token source that accepts only clients with a certificate from the test CA."""
    replica = ServiceProcess(
        "services.synthetic",
        [
            "--log-level", "WARNING",
            "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
            "--tls-client-ca", str(certs.ca),
        ],
    )  # fmt: skip
    try:
        # Health checks from the test helper speak plaintext, which an mTLS server refuses.
        replica.start(wait_serving=False, timeout=120)
        yield replica
    finally:
        replica.stop()


def start_router(replica: ServiceProcess, tls_args: list[str]) -> ServiceProcess:
    router = ServiceProcess("services.router", ["--replicas", replica.address, *ROUTER_ARGS, *tls_args])
    try:
        router.start(timeout=120)
    except BaseException:
        router.stop()
        raise
    return router


def complete(router: ServiceProcess, text: str) -> router_pb2.CompleteResponse:
    request = router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content=text)],
        sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0),
    )
    with grpc.insecure_channel(router.address) as channel:
        reply: router_pb2.CompleteResponse = router_pb2_grpc.RouterStub(channel).Complete(request, timeout=30)
        return reply


def test_router_with_client_certificate_completes_through_mtls_replica(
    mtls_replica: ServiceProcess, certs: CertPaths
) -> None:
    router = start_router(
        mtls_replica,
        [
            "--replica-tls-ca", str(certs.ca),
            "--replica-tls-cert", str(certs.client_cert),
            "--replica-tls-key", str(certs.client_key),
        ],
    )  # fmt: skip
    try:
        reply = complete(router, "hello over mTLS")
    finally:
        router.stop()
    assert len(reply.token_ids) == 3
    assert reply.end.replica == mtls_replica.address


def test_router_without_client_certificate_cannot_reach_mtls_replica(
    mtls_replica: ServiceProcess, certs: CertPaths
) -> None:
    router = start_router(mtls_replica, ["--replica-tls-ca", str(certs.ca)])
    try:
        with pytest.raises(grpc.RpcError) as err:
            complete(router, "hello without a certificate")
    finally:
        router.stop()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no inference replica is reachable" in (err.value.details() or "")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replica-tls-cert", "client.pem"], "--replica-tls-cert and --replica-tls-key go together"),
        (["--replica-tls-ca", "/nonexistent/ca.pem"], "--replica-tls-ca /nonexistent/ca.pem: cannot read"),
        (
            ["--session-addr", "127.0.0.1:2", "--session-tls-key", "client.key"],
            "--session-tls-cert and --session-tls-key go together",
        ),
        (
            ["--retriever-addr", "127.0.0.1:2", "--retriever-tls-ca", "/nonexistent/ca.pem"],
            "--retriever-tls-ca /nonexistent/ca.pem: cannot read",
        ),
        (["--retriever-tls-ca", __file__], "--retriever-tls-* without --retriever-addr"),
    ],
)
def test_router_refuses_incomplete_or_unreadable_tls_flags(flags: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.router", "--replicas", "127.0.0.1:1", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr
