"""The gateway's Kustomize component: the router pods gain a valid sidecar and the Service its port."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import yaml

from tests.support.gateway import GATEWAY_DIR, ROOT
from tests.unit.deploy.kustomize import apply_patch, load_documents, render, set_image

KUBERNETES_VERSION = "1.30.0"


def render_with_gateway(overlay: str) -> list[dict[str, Any]]:
    """An overlay rendered, then the component's patches and image tag applied."""
    # The offline renderer the deploy tests use; it has no components, so they are applied here.
    objects = render(ROOT / "deploy" / "k8s" / "overlays" / overlay)
    component = yaml.safe_load((GATEWAY_DIR / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    for patch in component["patches"]:
        for doc in load_documents(GATEWAY_DIR / patch["path"]):
            apply_patch(objects, doc, {})
    for image in component["images"]:
        set_image(objects, image)
    return objects


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def test_router_pods_get_a_gateway_sidecar_that_follows_router_health() -> None:
    objects = render_with_gateway("cpu")
    pod = find(objects, "Deployment", "router")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    router, gateway = containers["router"], containers["gateway"]
    ports = find(objects, "Service", "router")["spec"]["ports"]
    service_ports = {p["name"]: p for p in ports}
    # Kubernetes refuses a Service with two ports of one name, and a pod's port names must be
    # unique across its containers (a probe's named port must say which).
    assert len(service_ports) == len(ports), [p["name"] for p in ports]
    pod_port_names = [p["name"] for c in pod["containers"] for p in c.get("ports", [])]
    assert len(set(pod_port_names)) == len(pod_port_names), pod_port_names

    assert gateway["image"] == "llm-mesh/gateway:0.1.0"
    upstream = gateway["args"][gateway["args"].index("--upstream") + 1]
    assert upstream == f"127.0.0.1:{next(p['containerPort'] for p in router['ports'] if p['name'] == 'grpc')}"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/healthz"
    # /healthz waits up to the gateway's --health-timeout (2 s) for the router: the probe must wait longer.
    assert gateway["readinessProbe"]["timeoutSeconds"] > 2
    # kubectl logs/exec on the Deployment reach the router, not the distroless sidecar.
    annotations = find(objects, "Deployment", "router")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["kubectl.kubernetes.io/default-container"] == "router"
    assert "httpGet" not in gateway["livenessProbe"]
    grace = gateway["args"][gateway["args"].index("--shutdown-grace") + 1]
    assert int(grace.rstrip("s")) + 5 <= pod["terminationGracePeriodSeconds"]
    assert service_ports["rest"]["port"] == 8080 and service_ports["rest"]["targetPort"] == "rest"
    assert service_ports["http"]["port"] == 8000  # the router's OpenAI front stays
    assert service_ports["grpc"]["port"] == 50051
    for obj in (find(objects, "Deployment", "router"), find(objects, "Service", "router")):
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
