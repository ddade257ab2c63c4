"""The Kubernetes manifests: every rendered object validates against the Kubernetes schemas offline,
and the deployment choices the operations guide promises are really in them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.unit.deploy.kustomize import load_documents, render
from tests.unit.deploy.metric_names import exported_metric_names

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"
OVERLAYS = ["cpu", "gpu"]
SERVICES = {"router": 50051, "inference": 50052, "retriever": 50053, "session": 50054}


def rendered(overlay: str) -> list[dict[str, Any]]:
    return render(K8S / "overlays" / overlay)


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


SERVICES_BEHIND_MTLS = ["retriever", "session"]
# The keys cert-manager writes to a Certificate's Secret; deploy/k8s/make-certs.sh writes the same.
TLS_SECRET_KEYS = {"tls.crt", "tls.key", "ca.crt"}
CERT_MANAGER = "cert-manager.io/v1"


def validate(obj: dict[str, Any]) -> None:
    if obj["apiVersion"] == CERT_MANAGER:
        # No schemas offline for cert-manager's CRDs: check the shape these files rely on.
        assert obj["kind"] in {"Issuer", "Certificate"}, obj["kind"]
        assert obj["metadata"]["namespace"] == "llm-mesh", "a namespaced Issuer only signs in its namespace"
        spec = obj["spec"]
        if obj["kind"] == "Issuer":
            assert len(set(spec) & {"selfSigned", "ca"}) == 1, spec
        else:
            assert {"secretName", "issuerRef", "privateKey"} <= set(spec), spec
            assert set(spec.get("usages", [])) <= {"digital signature", "server auth", "client auth"}
        return
    # strict: unknown fields (typos like `readinesProbe`) fail too.
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_against_the_kubernetes_schema(overlay: str) -> None:
    objects = rendered(overlay)
    assert len(objects) >= 15
    for obj in objects:
        validate(obj)


def test_every_plain_manifest_file_validates_on_its_own() -> None:
    files = [
        p for p in K8S.rglob("*.yaml") if "third-party" not in p.parts and p.name != "kustomization.yaml"
    ]
    patch_files = {p for p in files if "overlays" in p.parts}
    for path in sorted(set(files) - patch_files):
        for doc in load_documents(path):
            validate(doc)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_has_deployment_service_and_disruption_budget(overlay: str) -> None:
    objects = rendered(overlay)
    for name, port in SERVICES.items():
        deployment = find(objects, "Deployment", name)
        pod = deployment["spec"]["template"]["spec"]
        main = container(deployment)
        for probe in ("readinessProbe", "livenessProbe"):
            assert probe_port(main[probe]) == port, f"{name}'s {probe} checks another port"
        assert main["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        assert pod["terminationGracePeriodSeconds"] >= 30
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert deployment["metadata"]["namespace"] == "llm-mesh"
        service_name = "inference-headless" if name == "inference" else name
        service = find(objects, "Service", service_name)
        assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        # The router also serves the OpenAI-compatible HTTP front, on 8000.
        extra = {8000} if name == "router" else set()
        assert {p["port"] for p in service["spec"]["ports"]} == {port, 9090, *extra}
        budget = find(objects, "PodDisruptionBudget", name)
        assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


def probe_port(probe: dict[str, Any]) -> int:
    """The port a kubelet gRPC probe, or the image's health check run as an exec probe, asks."""
    if "grpc" in probe:
        return int(probe["grpc"]["port"])
    command = probe["exec"]["command"]
    assert command[:2] == ["python", "/usr/local/bin/grpc_health_check.py"], command
    address = next(a for a in command[2:] if ":" in a and not a.startswith("-"))
    return int(address.rpartition(":")[2])


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return dict(deployment["spec"]["template"]["metadata"]["labels"])


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector form not modelled here: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def admits(objects: list[dict[str, Any]], target: dict[str, str], source: dict[str, str], port: int) -> bool:
    """Whether a pod labelled ``source`` in the namespace may open ``port`` on a pod labelled
    ``target``, by the NetworkPolicy rules (no policy selecting the target: everything may)."""
    policies = [
        o["spec"]
        for o in objects
        if o["kind"] == "NetworkPolicy" and selects(o["spec"]["podSelector"], target)
    ]
    if not any("Ingress" in p.get("policyTypes", ["Ingress"]) for p in policies):
        return True
    for rule in (r for p in policies for r in p.get("ingress", [])):
        port_ok = "ports" not in rule or any(int(q["port"]) == port for q in rule["ports"])
        peers = rule.get("from")
        peer_ok = peers is None or any(set(peer) == {"podSelector"} and selects(peer["podSelector"], source)
                                       for peer in peers)  # fmt: skip
        if port_ok and peer_ok:
            return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_router_pods_reach_the_grpc_ports_of_the_services_behind_it(overlay: str) -> None:
    # The tenant is metadata the router sets after checking the key: a pod that reached the retriever
    # (or session, or a replica) directly could act for any tenant.
    objects = rendered(overlay)
    router = pod_labels(find(objects, "Deployment", "router"))
    stranger = {"app.kubernetes.io/name": "debug-shell"}
    for name in ("retriever", "session", "inference"):
        target = pod_labels(find(objects, "Deployment", name))
        port = SERVICES[name]
        assert admits(objects, target, router, port), f"the router cannot reach the {name}"
        assert not admits(objects, target, stranger, port), f"any pod can call the {name}"
        for other in set(SERVICES) - {name, "router"}:
            assert not admits(objects, target, pod_labels(find(objects, "Deployment", other)), port)
        # Prometheus still scrapes it.
        assert admits(objects, target, {"app.kubernetes.io/name": "prometheus"}, 9090)
    # The router is the front door: nothing narrows who may call it.
    assert admits(objects, router, stranger, SERVICES["router"])


def test_router_resolves_inference_through_the_headless_service() -> None:
    objects = rendered("cpu")
    headless = find(objects, "Service", "inference-headless")
    assert headless["spec"]["clusterIP"] == "None"
    args = container(find(objects, "Deployment", "router"))["args"]
    target = args[args.index("--replicas-dns") + 1]
    assert target == "inference-headless.llm-mesh.svc.cluster.local:50052"


def test_retriever_replicas_sharing_milvus_take_document_write_leases_in_redis() -> None:
    retriever = find(rendered("cpu"), "Deployment", "retriever")
    assert retriever["spec"]["replicas"] > 1
    env = {e["name"]: e for e in container(retriever)["env"]}
    assert env["LLMMESH_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@$(REDIS_HOST):6379/0"
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "redis", "key": "redis-password"}


def test_retriever_takes_milvus_credentials_from_an_optional_secret_not_the_uri() -> None:
    objects = rendered("cpu")
    env = {e["name"]: e for e in container(find(objects, "Deployment", "retriever"))["env"]}
    token = env["LLMMESH_MILVUS_TOKEN"]["valueFrom"]["secretKeyRef"]
    # Optional: the chart's Milvus runs without auth, and then no Secret exists.
    assert token == {"name": "milvus-token", "key": "token", "optional": True}
    config = find(objects, "ConfigMap", "llm-mesh-config")["data"]
    assert "@" not in config["LLMMESH_MILVUS_URI"], "credentials belong in the Secret, not the ConfigMap"


def test_autoscaling_inference_on_queue_depth_and_router_on_cpu() -> None:
    objects = rendered("cpu")
    inference = find(objects, "HorizontalPodAutoscaler", "inference")
    assert inference["spec"]["scaleTargetRef"]["name"] == "inference"
    (metric,) = inference["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "llmmesh_queue_depth"
    # The replicas really export the gauge the autoscaler scales on.
    assert "llmmesh_queue_depth" in exported_metric_names()
    router = find(objects, "HorizontalPodAutoscaler", "router")
    (cpu,) = router["spec"]["metrics"]
    assert cpu["type"] == "Resource" and cpu["resource"]["name"] == "cpu"
    # The adapter that serves the custom metric is configured for the same name.
    adapter = yaml.safe_load((K8S / "third-party" / "prometheus-adapter.values.yaml").read_text())
    assert adapter["rules"]["custom"][0]["name"]["as"] == "llmmesh_queue_depth"


def test_gpu_overlay_runs_the_cuda_image_on_one_gpu_each() -> None:
    cpu_inference = container(find(rendered("cpu"), "Deployment", "inference"))
    gpu_objects = rendered("gpu")
    gpu_inference = container(find(gpu_objects, "Deployment", "inference"))
    assert cpu_inference["image"] == "llm-mesh/inference:0.1.0"
    assert gpu_inference["image"] == "llm-mesh/inference-cuda:0.1.0"
    assert gpu_inference["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e.get("value") for e in gpu_inference["env"]}
    assert env["LLMMESH_DEVICE"] == "cuda"
    # The patch merged into the base container instead of replacing its probes.
    assert gpu_inference["startupProbe"]["grpc"]["port"] == 50052
    assert find(gpu_objects, "HorizontalPodAutoscaler", "inference")["spec"]["maxReplicas"] == 4


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_are_told_their_memory_limit_so_the_kv_cache_fits_it(overlay: str) -> None:
    inference = container(find(rendered(overlay), "Deployment", "inference"))
    env = {e["name"]: e for e in inference["env"]}
    field = env["LLMMESH_MEMORY_LIMIT_MIB"]["valueFrom"]["resourceFieldRef"]
    assert field == {"containerName": "inference", "resource": "limits.memory", "divisor": "1Mi"}
    # The container has a memory limit for it to report (else Kubernetes reports the node's RAM).
    assert "memory" in inference["resources"]["limits"]
    if overlay == "cpu":
        # On CPU it sizes its KV cache to the limit and uses nearly all of it: a smaller request
        # made it the first pod evicted. (On a GPU the cache is in GPU memory.)
        assert inference["resources"]["requests"]["memory"] == inference["resources"]["limits"]["memory"]


def test_a_gpu_rollout_and_a_node_drain_never_wait_for_a_gpu_that_is_not_there() -> None:
    """With replicas equal to the GPUs, a surge replica can never be scheduled (the rollout
    stalls), and at one replica the disruption budget blocks every node drain."""
    objects = rendered("gpu")
    strategy = find(objects, "Deployment", "inference")["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxSurge"] == 0 and strategy["maxUnavailable"] == 1
    budget = find(objects, "PodDisruptionBudget", "inference")["spec"]
    hpa = find(objects, "HorizontalPodAutoscaler", "inference")["spec"]
    assert hpa["minReplicas"] > budget.get("minAvailable", 0)


def test_redis_and_milvus_come_from_their_charts_not_from_here() -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in rendered("cpu")}
    assert not any(kind == "StatefulSet" for kind, _ in kinds)
    config = find(rendered("cpu"), "ConfigMap", "llm-mesh-config")["data"]
    assert config["REDIS_HOST"].startswith("redis-master.")
    assert config["LLMMESH_MILVUS_URI"].startswith("http://milvus.")
    for chart in ("redis", "milvus"):
        values = (K8S / "third-party" / f"{chart}.values.yaml").read_text()
        assert "helm install" in values
        yaml.safe_load(values)
    # Bitnami's chart pins image tags that docker.io/bitnami no longer serves (Aug 2025): the
    # values must name an image that pulls, for Redis and for any sidecar they enable.
    redis = yaml.safe_load((K8S / "third-party" / "redis.values.yaml").read_text())
    assert redis["image"].get("tag") or redis["image"].get("digest")
    assert not redis["metrics"]["enabled"] or redis["metrics"].get("image", {}).get("repository")


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} given {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


def mounted_secret_file(deployment: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at ``path`` in the main container; fails if none is mounted there."""
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    directory, _, key = path.rpartition("/")
    for mount in container(deployment)["volumeMounts"]:
        if mount["mountPath"].rstrip("/") == directory and "secret" in volumes[mount["name"]]:
            assert mount.get("readOnly") is True
            secret = volumes[mount["name"]]["secret"]
            assert "items" not in secret, "every key of the Secret is a file in the mount"
            assert key in TLS_SECRET_KEYS, f"{path}: the Secret has no key {key}"
            return str(secret["secretName"]), key
    raise AssertionError(f"{path}: no Secret mounted at {directory}")


def certificate_for(objects: list[dict[str, Any]], secret: str) -> dict[str, Any]:
    (certificate,) = [o for o in objects if o["kind"] == "Certificate" and o["spec"]["secretName"] == secret]
    assert certificate["spec"]["issuerRef"] == {"kind": "Issuer", "name": "llm-mesh-ca"}
    return certificate


def host_of(address: str) -> str:
    return address.rpartition(":")[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("name", SERVICES_BEHIND_MTLS)
def test_the_services_behind_the_router_require_a_client_certificate_from_the_mesh_ca(
    overlay: str, name: str
) -> None:
    objects = rendered(overlay)
    deployment = find(objects, "Deployment", name)
    args = container(deployment)["args"]
    files = {
        f: mounted_secret_file(deployment, flag(args, f))
        for f in ("--tls-cert", "--tls-key", "--tls-client-ca")
    }
    assert {secret for secret, _ in files.values()} == {f"llm-mesh-{name}-tls"}
    assert {f: key for f, (_, key) in files.items()} == {
        "--tls-cert": "tls.crt", "--tls-key": "tls.key", "--tls-client-ca": "ca.crt"
    }  # fmt: skip
    spec = certificate_for(objects, f"llm-mesh-{name}-tls")["spec"]
    assert "server auth" in spec["usages"]
    # The name the router dials is one the certificate carries, so its hostname check passes.
    router_args = container(find(objects, "Deployment", "router"))["args"]
    dialled = host_of(flag(router_args, f"--{name}-addr"))
    assert dialled == f"{find(objects, 'Service', name)['metadata']['name']}.llm-mesh.svc.cluster.local"
    assert dialled in spec["dnsNames"]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("peer", SERVICES_BEHIND_MTLS)
def test_the_router_dials_them_with_its_client_certificate(overlay: str, peer: str) -> None:
    objects = rendered(overlay)
    router = find(objects, "Deployment", "router")
    args = container(router)["args"]
    ca, cert, key = (
        mounted_secret_file(router, flag(args, f"--{peer}-tls-{f}")) for f in ("ca", "cert", "key")
    )
    assert {s for s, _ in (ca, cert, key)} == {"llm-mesh-router-client-tls"}
    assert (ca[1], cert[1], key[1]) == ("ca.crt", "tls.crt", "tls.key")
    client = certificate_for(objects, "llm-mesh-router-client-tls")["spec"]
    assert "client auth" in client["usages"] and "server auth" not in client["usages"]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("name", SERVICES_BEHIND_MTLS)
def test_probes_on_an_mtls_port_ask_health_over_mtls_not_plaintext_grpc(overlay: str, name: str) -> None:
    # The kubelet's grpc: probes speak plaintext: the mTLS port would refuse them and the pods
    # would never be ready. A tcpSocket probe would pass before the model loads.
    objects = rendered(overlay)
    deployment = find(objects, "Deployment", name)
    main = container(deployment)
    probes = [main[p] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in main]
    assert len(probes) >= 2
    server = certificate_for(objects, f"llm-mesh-{name}-tls")["spec"]
    for probe in probes:
        assert "grpc" not in probe and "tcpSocket" not in probe
        command = probe["exec"]["command"]
        assert probe_port(probe) == SERVICES[name]
        for option in ("--tls-ca", "--tls-cert", "--tls-key"):
            assert mounted_secret_file(deployment, flag(command, option))[0] == f"llm-mesh-{name}-tls"
        # The probe dials 127.0.0.1 but checks the certificate against a name it really carries.
        assert flag(command, "--server-name") in server["dnsNames"]
        # The port demands a client certificate: the pod's own must be good for client auth.
        assert "client auth" in server["usages"]
        # The health check gives up after 3 s; the kubelet must not cut it off first.
        assert probe["timeoutSeconds"] > 3


def test_the_mesh_ca_is_bootstrapped_by_a_self_signed_issuer_in_the_namespace() -> None:
    objects = rendered("cpu")
    ca_issuer = find(objects, "Issuer", "llm-mesh-ca")["spec"]["ca"]
    ca = [
        o["spec"]
        for o in objects
        if o["kind"] == "Certificate" and o["spec"]["secretName"] == ca_issuer["secretName"]
    ]
    assert len(ca) == 1 and ca[0]["isCA"] is True
    assert "selfSigned" in find(objects, "Issuer", ca[0]["issuerRef"]["name"])["spec"]
    # Every Secret a Deployment mounts for TLS is one a Certificate here issues.
    issued = {o["spec"]["secretName"] for o in objects if o["kind"] == "Certificate"}
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        for volume in deployment["spec"]["template"]["spec"]["volumes"]:
            secret = volume.get("secret", {}).get("secretName", "")
            if secret.endswith("-tls"):
                assert secret in issued, f"{secret} is mounted but nothing issues it"
