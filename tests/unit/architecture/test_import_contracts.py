"""The import contracts in pyproject.toml: the real tree keeps them, and each fails on a planted violation.

A planted violation goes into a copy of ``services/`` in a temporary folder (the
checkout is never touched), and ``lint-imports`` runs there with the repository's
own contracts, as ``make lint`` runs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "pyproject.toml"


def lint_imports() -> str:
    beside = Path(sys.executable).parent / "lint-imports"
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    if found is None:
        pytest.fail("lint-imports is missing: install the dev extras (pip install -e '.[dev]')")
    return found


def run_contracts(tree: Path, *contract: str) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on ``tree`` with the repository's contracts (only ``contract`` if named)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    only = [arg for c in contract for arg in ("--contract", c)]
    return subprocess.run(
        [lint_imports(), str(CONFIG), "--no-cache", *only],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_keeps_every_contract() -> None:
    result = run_contracts(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


#: (the module that gets the planted import, the import, the id of the contract that must catch it)
VIOLATIONS = [
    pytest.param(
        "services/router/placement/pool.py",
        "from services.router.streams import relay",
        "router-layers",
        id="placement-imports-streams",
    ),
    pytest.param(
        "services/router/streams/relay.py",
        "from services.router.turns import pipeline",
        "router-layers",
        id="streams-imports-turns",
    ),
    pytest.param(
        "services/router/runtime.py",
        "from services.inference import engine",
        "services",
        id="router-imports-the-engine",
    ),
    pytest.param(
        "services/session/store.py",
        "from services.retriever import store",
        "services",
        id="session-imports-retriever",
    ),
    pytest.param(
        "services/common/metrics.py",
        "from services.router import metrics",
        "services",
        id="common-imports-a-service",
    ),
    pytest.param(
        "services/router/placement/ring.py",
        "import grpc",
        "placement-pure",
        id="ring-imports-grpc",
    ),
    pytest.param(
        "services/router/placement/prefix_index.py",
        "import asyncio",
        "placement-pure",
        id="prefix-index-imports-asyncio",
    ),
    pytest.param(
        "services/common/errors.py",
        "import grpc",
        "engine-no-grpc",
        id="domain-errors-import-grpc",
    ),
    pytest.param(
        "services/inference/engine.py",
        "from services.gen.llmmesh.v1 import inference_pb2",
        "engine-no-grpc",
        id="engine-imports-protobuf",
    ),
    pytest.param(
        "services/common/generate_many/server.py",
        "from services.inference import servicer",
        "generate-many-shared",
        id="protocol-imports-the-replica",
    ),
    pytest.param(
        "services/common/generate_many/merge.py",
        "from services.gen.llmmesh.v1 import inference_pb2",
        "generate-many-pure",
        id="merge-rule-imports-protobuf",
    ),
    pytest.param(
        "services/inference/scheduler.py",
        "import asyncio",
        "scheduler-pure",
        id="scheduler-imports-asyncio",
    ),
]


@pytest.mark.parametrize(("module", "planted", "contract"), VIOLATIONS)
def test_a_planted_violation_breaks_its_contract(
    tmp_path: Path, module: str, planted: str, contract: str
) -> None:
    shutil.copytree(ROOT / "services", tmp_path / "services", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{planted}  # planted by the test\n")
    result = run_contracts(tmp_path, contract)  # that contract alone: it is this one that breaks
    assert result.returncode != 0, result.stdout
    assert "1 broken" in result.stdout, result.stdout
    importer = module.removesuffix(".py").replace("/", ".")
    assert f"{importer} ->" in result.stdout, result.stdout  # the report names the planted import
