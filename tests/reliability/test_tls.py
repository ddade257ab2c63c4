"""TLS and mTLS on a service when certificates are configured (reliability matrix row 12)."""

from __future__ import annotations

import contextlib
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, session_pb2, session_pb2_grpc
from tests.support.certs import CertPaths, make_certs
from tests.support.openai_front import HTTP_RE
from tests.support.processes import ROOT, ServiceProcess
from tests.support.redis import RedisServer

TENANT = (("x-llmmesh-tenant", "acme"),)
SERVING = health_pb2.HealthCheckResponse.SERVING


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


def test_a_service_with_client_names_admits_only_certificates_that_carry_one(
    tmp_path: Path, certs: CertPaths
) -> None:
    """The client CA alone admitted any certificate it signed: in Kubernetes the session and
    retriever pods' own certificates (client auth too, for their probes) could call each other
    as any tenant. --tls-client-names admits only the names it lists."""
    redis = RedisServer(tmp_path / "redis").start()
    args = [
        "--redis-url", redis.url,
        "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
        "--tls-client-ca", str(certs.ca), "--tls-client-names", "llm-mesh client",
    ]  # fmt: skip
    service = ServiceProcess("services.session", args).start(wait_serving=False)
    try:

        def dial(cert: Path, key: Path) -> grpc.Channel:
            creds = grpc.ssl_channel_credentials(
                root_certificates=certs.ca.read_bytes(),
                private_key=key.read_bytes(),
                certificate_chain=cert.read_bytes(),
            )
            return grpc.secure_channel(f"localhost:{service.port}", creds)

        with dial(certs.client_cert, certs.client_key) as admitted:
            assert create(admitted).session_id
        with dial(certs.other_client_cert, certs.other_client_key) as other:
            with pytest.raises(grpc.RpcError) as refused:
                create(other)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "llm-mesh other client" in (refused.value.details() or "")
            assert "--tls-client-names" in (refused.value.details() or "")
    finally:
        service.stop()
        redis.kill()


@contextlib.contextmanager
def tls_router_over_a_fake_replica(certs: CertPaths, *extra: str) -> Iterator[ServiceProcess]:
    """A router with TLS on its ports, in front of a synthetic token source (fake replica)."""
    replica = ServiceProcess("services.synthetic", ["--log-level", "WARNING"])
    router: ServiceProcess | None = None
    try:
        replica.start(timeout=120)
        router = ServiceProcess(
            "services.router",
            [
                "--replicas", replica.address, "--probe-interval-s", "0", "--log-level", "WARNING",
                "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), *extra,
            ],
        )  # fmt: skip
        # Health checks speak plaintext: wait for the TLS client's own call instead.
        router.start(wait_serving=False, timeout=120)
        yield router
    finally:
        if router is not None:
            router.stop()
        replica.stop()


@pytest.fixture(scope="module")
def tls_router(certs: CertPaths) -> Iterator[ServiceProcess]:
    """The router's front door with TLS, in front of a synthetic token source (fake replica)."""
    with tls_router_over_a_fake_replica(certs) as router:
        yield router


def test_router_front_door_serves_tls_clients_and_refuses_plaintext(
    tls_router: ServiceProcess, certs: CertPaths
) -> None:
    request = router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content="hello over TLS")],
        sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0),
    )
    creds = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
    with grpc.secure_channel(f"localhost:{tls_router.port}", creds) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 60
        while health.Check(health_pb2.HealthCheckRequest(), timeout=5, wait_for_ready=True).status != SERVING:
            assert time.monotonic() < deadline, "router never SERVING over TLS"
            time.sleep(0.2)
        reply = router_pb2_grpc.RouterStub(channel).Complete(request, timeout=30)
        assert len(reply.token_ids) == 3
    with grpc.insecure_channel(f"127.0.0.1:{tls_router.port}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            router_pb2_grpc.RouterStub(channel).Complete(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def https_port(router: ServiceProcess, timeout: float = 30.0) -> int:
    """The HTTP front's port, from its ``http on`` line, which says it is HTTPS."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in router.lines:
            if (m := HTTP_RE.search(line)) is not None:
                assert "(https: TLS)" in line, line
                return int(m.group(2))
        time.sleep(0.05)
    raise TimeoutError(router.output())


def test_the_openai_front_of_a_tls_router_is_https_and_refuses_plaintext(
    tls_router: ServiceProcess, certs: CertPaths
) -> None:
    """The router's gRPC port took TLS while its HTTP front served the same API keys in plaintext
    beside it. With --tls-cert the HTTP front is HTTPS with the same certificate."""
    port = https_port(tls_router)
    trusting = ssl.create_default_context(cafile=str(certs.ca))
    listed = httpx.get(f"https://localhost:{port}/v1/models", verify=trusting, timeout=10)
    assert listed.status_code == 200 and listed.json()["object"] == "list"
    with pytest.raises(httpx.HTTPError):  # TLS only: a plaintext request is not answered
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)


def test_the_openai_front_of_an_mtls_router_needs_a_client_certificate(certs: CertPaths) -> None:
    with tls_router_over_a_fake_replica(certs, "--tls-client-ca", str(certs.ca)) as router:
        url = f"https://localhost:{https_port(router)}/v1/models"
        with_certificate = ssl.create_default_context(cafile=str(certs.ca))
        with_certificate.load_cert_chain(str(certs.client_cert), str(certs.client_key))
        assert httpx.get(url, verify=with_certificate, timeout=10).status_code == 200
        with pytest.raises(httpx.HTTPError):  # the handshake (or the first read) fails without one
            httpx.get(url, verify=ssl.create_default_context(cafile=str(certs.ca)), timeout=5)


def test_the_cli_reaches_a_tls_router_with_its_ca_and_says_tls_without_it(
    tls_router: ServiceProcess, certs: CertPaths
) -> None:
    """The terminal clients had no TLS flags: against a TLS router they said the mesh was down."""
    router = f"localhost:{tls_router.port}"
    ask = [
        sys.executable,
        "-m",
        "services.cli",
        "ask",
        "hello over TLS",
        "--router",
        router,
        "--max-tokens",
        "3",
    ]
    deadline = time.monotonic() + 60
    while True:  # the router may still be learning its replica
        done = subprocess.run(
            [*ask, "--tls-ca", str(certs.ca)], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        if done.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    plain = subprocess.run(ask, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1 and "--tls" in plain.stderr, plain.stderr
    missing = subprocess.run(
        [*ask, "--tls-ca", "/nonexistent/ca.pem"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "--tls-ca" in missing.stderr, missing.stderr


def test_router_reaches_an_mtls_replica_only_with_its_client_certificate(certs: CertPaths) -> None:
    """mTLS between services: a replica that demands client certificates, and two routers."""
    replica = ServiceProcess(
        "services.synthetic",
        [
            "--log-level", "WARNING", "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
            "--tls-client-ca", str(certs.ca),
        ],
    )  # fmt: skip
    routers: list[ServiceProcess] = []
    try:
        replica.start(wait_serving=False, timeout=120)
        common = [
            "--replicas",
            f"localhost:{replica.port}",
            "--probe-interval-s",
            "0",
            "--log-level",
            "WARNING",
        ]
        with_cert = ServiceProcess(
            "services.router",
            [
                *common, "--replica-tls-ca", str(certs.ca), "--replica-tls-cert", str(certs.client_cert),
                "--replica-tls-key", str(certs.client_key),
            ],
        )  # fmt: skip
        without_cert = ServiceProcess("services.router", [*common, "--replica-tls-ca", str(certs.ca)])
        routers = [with_cert, without_cert]
        for router in routers:
            router.start(timeout=120)
        request = router_pb2.ChatRequest(
            messages=[common_pb2.ChatMessage(role="user", content="hello over mTLS")],
            sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0),
        )
        with grpc.insecure_channel(with_cert.address) as channel:
            reply = router_pb2_grpc.RouterStub(channel).Complete(request, timeout=30)
            assert len(reply.token_ids) == 3
        # The replica refuses the handshake of a router without a client certificate.
        with grpc.insecure_channel(without_cert.address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                router_pb2_grpc.RouterStub(channel).Complete(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for p in [*routers, replica]:
            p.stop()


def session_turn(router: ServiceProcess, text: str, required: bool = False) -> router_pb2.CompleteResponse:
    request = router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content=text)],
        sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0),
        session_id="conversation-over-mtls",
        session_required=required,
    )
    with grpc.insecure_channel(router.address) as channel:
        reply: router_pb2.CompleteResponse = router_pb2_grpc.RouterStub(channel).Complete(request, timeout=30)
        return reply


def test_router_keeps_history_in_an_mtls_session_service_only_with_its_client_certificate(
    mtls_service: ServiceProcess, certs: CertPaths
) -> None:
    """The session service holds every conversation: the router reaches it over mTLS, or not at all."""
    replica = ServiceProcess("services.synthetic", ["--log-level", "WARNING"])
    routers: list[ServiceProcess] = []
    try:
        replica.start(timeout=120)
        common = [
            "--replicas", replica.address, "--probe-interval-s", "0", "--log-level", "WARNING",
            "--session-addr", f"localhost:{mtls_service.port}", "--session-tls-ca", str(certs.ca),
        ]  # fmt: skip
        with_cert = ServiceProcess(
            "services.router",
            [
                *common,
                "--session-tls-cert",
                str(certs.client_cert),
                "--session-tls-key",
                str(certs.client_key),
            ],
        )
        without_cert = ServiceProcess("services.router", common)
        routers = [with_cert, without_cert]
        for router in routers:
            router.start(timeout=120)
        first = session_turn(with_cert, "My name is Ada.")
        second = session_turn(with_cert, "What is my name?", required=True)
        assert not first.end.degraded and not second.end.degraded, second.end.degraded_reasons
        assert second.end.session_version > first.end.session_version > 0
        # Without its certificate the router cannot open the session: the turn is answered without
        # history and says so, or refused when the client requires the session.
        degraded = session_turn(without_cert, "What is my name?")
        assert degraded.end.degraded and len(degraded.token_ids) == 3
        assert any(r.startswith("history:") for r in degraded.end.degraded_reasons)
        with pytest.raises(grpc.RpcError) as err:
            session_turn(without_cert, "What is my name?", required=True)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for p in [*routers, replica]:
            p.stop()
