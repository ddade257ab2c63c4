"""The Kubernetes mTLS setup, run for real outside a cluster: deploy/k8s/make-certs.sh makes the
certificates, a retriever runs with the TLS flags of the rendered Deployment (mount paths pointed at
the script's files), and the Deployment's own probe command decides whether it is ready.

The router's client certificate gets in under the Service name the router dials; a caller without
it (plaintext, TLS with no certificate, or a certificate from another CA) is refused before any RPC.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.common.metadata import TENANT_KEY
from services.gen.llmmesh.v1 import retriever_pb2, retriever_pb2_grpc
from tests.support.certs import make_certs
from tests.support.processes import ServiceProcess
from tests.unit.deploy.kustomize import render

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "k8s" / "make-certs.sh"
HEALTH_CHECK = ROOT / "deploy" / "docker" / "grpc_health_check.py"
OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "cpu"


def deployment(name: str) -> dict[str, Any]:
    (found,) = [o for o in render(OVERLAY) if o["kind"] == "Deployment" and o["metadata"]["name"] == name]
    return found


def container(name: str) -> dict[str, Any]:
    return dict(deployment(name)["spec"]["template"]["spec"]["containers"][0])


def localized(name: str, args: list[str], secrets: Path) -> list[str]:
    """``args`` with each Secret's mount path in the ``name`` pod replaced by the script's folder for it."""
    pod = deployment(name)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {
        m["mountPath"]: secrets / volumes[m["name"]]["secret"]["secretName"]
        for m in pod["containers"][0]["volumeMounts"]
        if "secret" in volumes[m["name"]]
    }
    out = []
    for arg in args:
        for mount, folder in mounts.items():
            if arg.startswith(mount + "/"):
                arg = str(folder / arg.removeprefix(mount + "/"))
        out.append(arg)
    return out


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(tmp_path_factory.mktemp("mesh-certs"))
    result = subprocess.run([str(SCRIPT), str(folder)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return folder


def run_probe(probe: dict[str, Any], port: int, secrets: Path) -> subprocess.CompletedProcess[str]:
    """The retriever's exec probe as the kubelet runs it in the pod, against the local retriever."""
    command = localized("retriever", probe["exec"]["command"], secrets)
    assert command[:2] == ["python", "/usr/local/bin/grpc_health_check.py"]
    command = [sys.executable, str(HEALTH_CHECK), *command[2:]]
    command[-1] = f"127.0.0.1:{port}"  # the pod's fixed port, here an ephemeral one
    return subprocess.run(command, capture_output=True, text=True, timeout=probe["timeoutSeconds"] + 5)


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory, secrets: Path) -> Iterator[ServiceProcess]:
    """The retriever with the rendered Deployment's args (TLS flags included), on Milvus Lite; ready
    when the Deployment's own readiness probe passes."""
    data = Path(tmp_path_factory.mktemp("retriever"))
    args = localized("retriever", container("retriever")["args"], secrets)
    service = ServiceProcess("services.retriever", [*args, "--milvus-uri", str(data / "milvus.db")])
    try:
        service.start(wait_serving=False, timeout=300)
        assert service.port is not None
        deadline = time.monotonic() + 300
        while (
            probe := run_probe(container("retriever")["readinessProbe"], service.port, secrets)
        ).returncode:
            assert time.monotonic() < deadline, f"the readiness probe never passed: {probe.stderr}"
            time.sleep(1)
        assert "SERVING" in probe.stdout
        yield service
    finally:
        service.stop()


def router_credentials(secrets: Path) -> grpc.ChannelCredentials:
    """What the router pod dials with: its --retriever-tls-* files from the manifest."""
    args = localized("router", container("router")["args"], secrets)
    return grpc.ssl_channel_credentials(
        root_certificates=Path(flag(args, "--retriever-tls-ca")).read_bytes(),
        private_key=Path(flag(args, "--retriever-tls-key")).read_bytes(),
        certificate_chain=Path(flag(args, "--retriever-tls-cert")).read_bytes(),
    )


def list_documents(channel: grpc.Channel) -> retriever_pb2.ListDocumentsResponse:
    response: retriever_pb2.ListDocumentsResponse = retriever_pb2_grpc.RetrieverStub(channel).ListDocuments(
        retriever_pb2.ListDocumentsRequest(), metadata=((TENANT_KEY, "acme"),), timeout=10
    )
    return response


def test_the_script_makes_every_tls_secret_the_deployments_mount(secrets: Path) -> None:
    mounted = {
        v["secret"]["secretName"]
        for name in ("router", "retriever", "session")
        for v in deployment(name)["spec"]["template"]["spec"]["volumes"]
        if v.get("secret", {}).get("secretName", "").endswith("-tls")
    }
    assert mounted == {"llm-mesh-retriever-tls", "llm-mesh-session-tls", "llm-mesh-router-client-tls"}
    for secret in mounted:
        assert {p.name for p in (secrets / secret).iterdir()} == {"tls.crt", "tls.key", "ca.crt"}


def test_the_manifests_probe_passes_over_mtls_where_a_plaintext_one_is_refused(
    retriever: ServiceProcess, secrets: Path
) -> None:
    assert retriever.port is not None
    for probe in ("startupProbe", "livenessProbe"):
        result = run_probe(container("retriever")[probe], retriever.port, secrets)
        assert result.returncode == 0, result.stderr
    # What the kubelet's grpc: probe would do: no TLS at all.
    plaintext = subprocess.run(
        [sys.executable, str(HEALTH_CHECK), retriever.address], capture_output=True, text=True, timeout=30
    )
    assert plaintext.returncode == 1
    assert "UNAVAILABLE" in plaintext.stderr


def test_the_routers_certificate_is_admitted_under_the_service_name_it_dials(
    retriever: ServiceProcess, secrets: Path
) -> None:
    dialled = flag(container("router")["args"], "--retriever-addr").rpartition(":")[0]
    assert dialled == "retriever.llm-mesh.svc.cluster.local"
    # The router resolves that name to a pod; here it is 127.0.0.1, checked against the same name.
    options = [("grpc.ssl_target_name_override", dialled)]
    with grpc.secure_channel(retriever.address, router_credentials(secrets), options=options) as channel:
        assert list(list_documents(channel).documents) == []
    # A name the certificate does not carry fails the router's hostname check.
    options = [("grpc.ssl_target_name_override", "retriever.elsewhere.svc.cluster.local")]
    with grpc.secure_channel(retriever.address, router_credentials(secrets), options=options) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list_documents(channel)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_caller_without_the_routers_certificate_is_refused(
    retriever: ServiceProcess, secrets: Path, tmp_path: Path
) -> None:
    name = [("grpc.ssl_target_name_override", "retriever.llm-mesh.svc.cluster.local")]
    ca = (secrets / "ca.crt").read_bytes()
    stranger = make_certs(tmp_path)  # a client certificate, but from a CA the mesh does not trust
    callers = {
        "plaintext": grpc.insecure_channel(retriever.address),
        "no certificate": grpc.secure_channel(retriever.address, grpc.ssl_channel_credentials(ca), name),
        "another CA's certificate": grpc.secure_channel(
            retriever.address,
            grpc.ssl_channel_credentials(
                ca, stranger.client_key.read_bytes(), stranger.client_cert.read_bytes()
            ),
            name,
        ),
    }
    for caller, channel in callers.items():
        with channel:
            with pytest.raises(grpc.RpcError) as refused:
                list_documents(channel)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, caller


def test_another_mesh_pods_certificate_is_refused_though_the_mesh_ca_signed_it(
    retriever: ServiceProcess, secrets: Path
) -> None:
    """The session pod's certificate (the mesh CA's, issued for client auth too, for its probes)
    got a full answer from the retriever: a compromised session pod could read any tenant's
    documents. --tls-client-names admits the router's and the retriever's own only."""
    name = [("grpc.ssl_target_name_override", "retriever.llm-mesh.svc.cluster.local")]
    session_pod = secrets / "llm-mesh-session-tls"
    creds = grpc.ssl_channel_credentials(
        (session_pod / "ca.crt").read_bytes(),
        (session_pod / "tls.key").read_bytes(),
        (session_pod / "tls.crt").read_bytes(),
    )
    with grpc.secure_channel(retriever.address, creds, name) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list_documents(channel)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "session.llm-mesh.svc" in (refused.value.details() or "")


def test_a_session_service_whose_redis_is_down_is_not_ready_but_alive() -> None:
    """The session service says NOT_SERVING while Redis is unreachable. Its liveness probe asked
    for SERVING, so a Redis restart restarted every session pod (and CrashLoopBackOff kept them
    down after Redis was back); liveness now only asks that the server answers (--alive)."""
    probes = container("session")
    assert "--alive" in probes["livenessProbe"]["exec"]["command"]
    assert "--alive" not in probes["readinessProbe"]["exec"]["command"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    session = ServiceProcess("services.session", ["--redis-url", f"redis://127.0.0.1:{closed}/0"])
    try:
        session.start(wait_serving=False, timeout=120)
        address = f"127.0.0.1:{session.port}"

        def check(*flags: str) -> subprocess.CompletedProcess[str]:
            command = [sys.executable, str(HEALTH_CHECK), *flags, address]
            return subprocess.run(command, capture_output=True, text=True, timeout=20)

        deadline = time.monotonic() + 30
        while "NOT_SERVING" not in (ready := check()).stdout:
            assert time.monotonic() < deadline, ready.stdout + ready.stderr
            time.sleep(0.5)
        assert ready.returncode == 1  # readiness: out of the Service while Redis is away
        alive = check("--alive")
        assert alive.returncode == 0 and "NOT_SERVING" in alive.stdout  # liveness: not restarted
    finally:
        session.stop()
