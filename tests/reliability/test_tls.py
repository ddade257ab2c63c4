"""TLS and mTLS on a service when certificates are configured (reliability matrix row 12)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.gen.llmmesh.v1 import session_pb2, session_pb2_grpc
from tests.support.certs import CertPaths, make_certs
from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer

TENANT = (("x-llmmesh-tenant", "acme"),)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return make_certs(Path(tmp_path_factory.mktemp("certs")))


@pytest.fixture(scope="module")
def mtls_service(tmp_path_factory: pytest.TempPathFactory, certs: CertPaths) -> Iterator[ServiceProcess]:
    redis = RedisServer(Path(tmp_path_factory.mktemp("redis"))).start()
    args = [
        "--redis-url", redis.url,
        "--tls-cert", str(certs.server_cert),
        "--tls-key", str(certs.server_key),
        "--tls-client-ca", str(certs.ca),
    ]  # fmt: skip
    proc = ServiceProcess("services.session", args)
    proc.start(wait_serving=False)
    yield proc
    proc.stop()
    redis.kill()


def create(channel: grpc.Channel) -> session_pb2.SessionInfo:
    stub = session_pb2_grpc.SessionStub(channel)
    return stub.CreateSession(
        session_pb2.CreateSessionRequest(), metadata=TENANT, timeout=10, wait_for_ready=True
    )


def test_mtls_client_with_certificate_is_served(mtls_service: ServiceProcess, certs: CertPaths) -> None:
    creds = grpc.ssl_channel_credentials(
        root_certificates=certs.ca.read_bytes(),
        private_key=certs.client_key.read_bytes(),
        certificate_chain=certs.client_cert.read_bytes(),
    )
    with grpc.secure_channel(f"localhost:{mtls_service.port}", creds) as channel:
        assert create(channel).session_id


def test_client_without_certificate_is_refused(mtls_service: ServiceProcess, certs: CertPaths) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
    with grpc.secure_channel(f"localhost:{mtls_service.port}", creds) as channel:
        stub = session_pb2_grpc.SessionStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.CreateSession(session_pb2.CreateSessionRequest(), metadata=TENANT, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_client_is_refused(mtls_service: ServiceProcess) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{mtls_service.port}") as channel:
        stub = session_pb2_grpc.SessionStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.CreateSession(session_pb2.CreateSessionRequest(), metadata=TENANT, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
