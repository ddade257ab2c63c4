"""Dockerfiles and the compose file: parsed, and holding the promises made for them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
KNOWN = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}  # fmt: skip


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path.name}: dangling line continuation"
    parsed = []
    for line in logical:
        word, _, rest = line.partition(" ")
        parsed.append((word.upper(), rest.strip()))
    return parsed


def test_a_dockerfile_per_service_and_a_cuda_variant() -> None:
    names = {p.name.removesuffix(".Dockerfile") for p in DOCKERFILES}
    assert names == {"router", "session", "retriever", "inference", "inference-cuda"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_multi_stage_non_root_and_health_checked(path: Path) -> None:
    parsed = instructions(path)
    unknown = [word for word, _ in parsed if word not in KNOWN]
    assert not unknown, f"unknown instructions {unknown}"
    words = [word for word, _ in parsed]
    # Only ARG may come before the first FROM.
    assert all(w == "ARG" for w in words[: words.index("FROM")])
    assert words.count("FROM") >= 2, "multi-stage: a build stage and a slim runtime"
    users = [args for word, args in parsed if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    (health,) = [args for word, args in parsed if word == "HEALTHCHECK"]
    assert "grpc_health_check.py" in health and "CMD" in health
    runs = " ".join(args for word, args in parsed if word == "RUN")
    assert "services.common.protogen" in runs, "generated protos are built inside the image"
    for word, args in parsed:
        if word == "COPY" and "--from=" not in args:
            sources = [a for a in args.split() if not a.startswith("--")][:-1]
            for source in sources:
                assert (ROOT / source).exists(), f"COPY source {source} missing"
    entry = next(args for word, args in parsed if word == "ENTRYPOINT")
    module = re.search(r'"services\.(\w+)"', entry)
    assert module is not None and (ROOT / "services" / module.group(1)).is_dir()


def test_cuda_variant_installs_the_cuda_torch_build() -> None:
    cuda = (DOCKER / "inference-cuda.Dockerfile").read_text()
    cpu = (DOCKER / "inference.Dockerfile").read_text()
    assert "whl/cu" in cuda and "LLMMESH_DEVICE=cuda" in cuda
    assert "whl/cpu" in cpu and "LLMMESH_DEVICE=cpu" in cpu


def test_compose_runs_every_service_with_redis_milvus_and_health_checks() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"redis", "milvus", "router", "inference", "session", "retriever"} <= set(services)
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        build = service.get("build")
        if build:
            assert (ROOT / "deploy" / build["context"] / build["dockerfile"]).exists()
    router = services["router"]
    assert router["ports"] == ["127.0.0.1:50051:50051", "127.0.0.1:8000:8000"]
    assert all(services[d]["healthcheck"] for d in router["depends_on"])
    assert services["session"]["environment"]["LLMMESH_REDIS_URL"].startswith("redis://redis:")
    assert services["retriever"]["environment"]["LLMMESH_MILVUS_URI"] == "http://milvus:19530"
    # Scaled retrievers share one Milvus: their document write leases live in Redis.
    assert services["retriever"]["environment"]["LLMMESH_REDIS_URL"].startswith("redis://redis:")
    # Scaled replicas each size their KV cache from their own container's limit, not the host's.
    assert services["inference"]["mem_limit"] == "4g"


def test_readme_deploy_section_names_the_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Deploy") :]
    for command in (
        "docker build -f deploy/docker/",
        "docker compose -f deploy/compose.yaml up",
        "kubectl apply -k deploy/k8s/overlays/cpu",
        "kubectl apply -k deploy/k8s/overlays/gpu",
        "helm install redis",
        "helm install milvus",
    ):
        assert command in section, f"README deploy section lacks `{command}`"


def test_the_router_image_carries_a_tokenizer_that_hashes_as_the_model_dir_does(tmp_path: Path) -> None:
    """The router image copies only the tokenizer files out of the model the build stage fetched,
    and points LLMMESH_TOKENIZER at them: those files alone must tokenize a chat exactly as the
    whole model directory does, or `--policy prefix` would hash blocks no replica holds."""
    from services.router.placement.prompt_hashes import load_tokenizer

    parsed = instructions(DOCKER / "router.Dockerfile")
    runs = " ".join(args for word, args in parsed if word == "RUN")
    assert "services.inference.fetch_model --out /models/SmolLM2-135M-Instruct" in runs
    (copy,) = [args for word, args in parsed if word == "COPY" and "/models/" in args]
    *sources, destination = [a for a in copy.split() if not a.startswith("--")]
    env = " ".join(args for word, args in parsed if word == "ENV")
    assert f"LLMMESH_TOKENIZER={destination.rstrip('/')}" in env
    assert not any(name.endswith((".safetensors", ".gguf")) for name in sources), "weights in the router"

    model = ROOT / "models" / "SmolLM2-135M-Instruct"
    image_dir = tmp_path / "tokenizer"
    image_dir.mkdir()
    for source in sources:
        (image_dir / Path(source).name).write_bytes((model / Path(source).name).read_bytes())
    chat = [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Wie spät ist es in Tōkyō? 🙂"},
    ]
    full, copied = load_tokenizer(str(model)), load_tokenizer(str(image_dir))

    def token_ids(tokenizer: Any) -> list[int]:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))

    expected = token_ids(full)
    assert token_ids(copied) == expected
    assert len(expected) > 20
