"""One local mesh (`llm-mesh up`) shared by the e2e modules; restarted only if a test stopped it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.launched_mesh import LaunchedMesh

_current: list[LaunchedMesh] = []


@pytest.fixture(scope="session")
def mesh_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LaunchedMesh]]:
    yield _current
    for mesh in _current:
        mesh.stop()


@pytest.fixture()
def mesh(mesh_factory: list[LaunchedMesh], tmp_path_factory: pytest.TempPathFactory) -> LaunchedMesh:
    """The running mesh; a test that stops it (the SIGTERM test) makes the next one start afresh."""
    if mesh_factory and mesh_factory[-1].alive():
        return mesh_factory[-1]
    base = tmp_path_factory.mktemp("mesh")
    launched = LaunchedMesh(base / "data", base / "spans.jsonl").start()
    mesh_factory.append(launched)
    return launched
