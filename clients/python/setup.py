"""Builds llm-mesh-client with its gRPC stubs generated from the repository's protos/.

Everything else is in pyproject.toml; this file only hooks stub generation into build_py,
so `pip install ./clients/python` works on a fresh clone with no step before it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def load_stubgen():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("llm_mesh_stubgen", HERE / "stubgen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithStubs(build_py):
    """build_py, then the stubs: into the build tree for a wheel, beside the sources when editable."""

    def run(self) -> None:
        super().run()
        stubgen = load_stubgen()
        if getattr(self, "editable_mode", False):
            stubgen.generate(stubgen.DEFAULT_OUT)
        else:
            stubgen.generate(Path(self.build_lib) / "llm_mesh_client" / "_gen")


setup(cmdclass={"build_py": BuildWithStubs})
