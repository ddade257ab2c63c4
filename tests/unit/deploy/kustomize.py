"""A small offline Kustomize renderer: the subset deploy/k8s uses, so tests need no kustomize binary.

Supported: ``resources`` (files and directories with a kustomization), ``components``
(directories with a ``kind: Component`` kustomization, applied after the resources), ``namespace``,
``labels`` (metadata only), ``images`` and ``patches`` (strategic-merge files with a
kind/name target; lists of named items merge by ``name``, other lists are replaced).
Anything else in a kustomization fails loudly, so the renderer never silently
diverges from what `kubectl apply -k` would do.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "components", "namespace", "labels", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}


def load_documents(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def render(directory: Path, accumulated: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize directory` would print (for the supported subset).

    ``accumulated``: the objects a ``kind: Component`` at ``directory`` is applied to."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED_KEYS
    if unknown:
        raise ValueError(f"{directory}: kustomization keys this renderer does not know: {sorted(unknown)}")
    is_component = kustomization.get("kind") == "Component"
    if is_component != (accumulated is not None):
        raise ValueError(
            f"{directory}: a Component goes under `components:`, anything else under `resources:`"
        )
    objects: list[dict[str, Any]] = list(accumulated or [])
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        objects += render(path) if path.is_dir() else load_documents(path)
    # As kustomize does: a component's resources join, and its patches and transformers apply to,
    # everything accumulated so far, before this kustomization's own transformers run.
    for component in kustomization.get("components", []):
        objects = render(directory / component, objects)
    for patch in kustomization.get("patches", []):
        apply_patch(objects, load_documents(directory / patch["path"])[0], patch.get("target", {}))
    for image in kustomization.get("images", []):
        set_image(objects, image)
    for label in kustomization.get("labels", []):
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = kustomization["namespace"]
    return objects


def apply_patch(objects: list[dict[str, Any]], patch: dict[str, Any], target: dict[str, str]) -> None:
    kind = target.get("kind", patch["kind"])
    name = target.get("name", patch["metadata"]["name"])
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(matches) != 1:
        raise ValueError(f"patch target {kind}/{name} matched {len(matches)} objects")
    body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind", "metadata")}
    merged = strategic_merge(matches[0], body)
    matches[0].clear()
    matches[0].update(merged)


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = strategic_merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    merge_key = _merge_key(field, patch)
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and _keyed(base, merge_key)
        and _keyed(patch, merge_key)
    ):
        out_list = copy.deepcopy(base)
        for item in patch:
            existing = next((i for i, b in enumerate(out_list) if b[merge_key] == item[merge_key]), None)
            if existing is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[existing] = strategic_merge(out_list[existing], item)
        return out_list
    return copy.deepcopy(patch)


def _merge_key(field: str, patch: Any) -> str:
    """Kubernetes' patchMergeKey: ports merge by their number (a Service's ``port``, a
    container's ``containerPort``), as kustomize merges them, so a patch's port of another
    number is added beside a same-named one; containers, env, volumes by ``name``."""
    if field == "ports" and isinstance(patch, list) and patch and isinstance(patch[0], dict):
        return "containerPort" if "containerPort" in patch[0] else "port"
    return "name"


def _keyed(items: list[Any], key: str) -> bool:
    return bool(items) and all(isinstance(i, dict) and key in i for i in items)


def set_image(objects: list[dict[str, Any]], image: dict[str, str]) -> None:
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []):
            name, _, tag = container["image"].partition(":")
            if name != image["name"]:
                continue
            container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"
