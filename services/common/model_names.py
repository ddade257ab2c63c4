"""The name a replica serves its model under when no ``--model-id`` is given: one rule, so the
launcher's examples name the model exactly as ``/v1/models`` will."""

from __future__ import annotations

from pathlib import PurePath


def served_model_name(path: str | PurePath) -> str:
    """A model directory's name, or a ``.gguf`` file's name without the extension."""
    p = PurePath(path)
    return p.stem if p.suffix == ".gguf" else p.name
