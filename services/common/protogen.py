"""Generate the Python protobuf/gRPC modules (and typing stubs) from protos/.

Generated code is not committed: ``make proto`` (run by ``make setup``) writes
it to ``services/gen/``. protoc emits absolute imports such as
``from llmmesh.v1 import common_pb2``; we rewrite them to
``services.gen.llmmesh.v1`` so the generated package lives inside ``services``
and needs no install step or sys.path tweak.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "services" / "gen"
IMPORT_RE = re.compile(r"^(from|import) llmmesh\.v1", re.MULTILINE)


def include_dirs() -> list[str]:
    """protoc include paths: ours, grpc_tools' well-known types, googleapis protos."""
    import grpc_tools

    dirs = [str(PROTO_DIR), str(Path(grpc_tools.__file__).parent / "_proto")]
    try:
        import google.api

        # googleapis-common-protos ships google/api/*.proto beside its modules.
        dirs.append(str(Path(google.api.__path__[0]).parents[1]))
    except ImportError:  # pragma: no cover
        pass
    return dirs


def generate() -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.rglob("*.proto"))
    if OUT_DIR.exists():
        shutil.rmtree(OUT_DIR)
    OUT_DIR.mkdir(parents=True)
    args = ["grpc_tools.protoc", *(f"-I{d}" for d in include_dirs())]
    args += [f"--python_out={OUT_DIR}", f"--grpc_python_out={OUT_DIR}"]
    plugin = Path(sys.executable).parent / "protoc-gen-mypy"
    if plugin.exists():
        args += [
            f"--plugin=protoc-gen-mypy={plugin}",
            f"--plugin=protoc-gen-mypy_grpc={plugin.parent / 'protoc-gen-mypy_grpc'}",
            f"--mypy_out={OUT_DIR}",
            f"--mypy_grpc_out={OUT_DIR}",
        ]
    args += [str(p.relative_to(PROTO_DIR)) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for path in OUT_DIR.rglob("*.py*"):
        if path.suffix not in (".py", ".pyi"):
            continue
        text = path.read_text()
        path.write_text(IMPORT_RE.sub(r"\1 services.gen.llmmesh.v1", text))
        written.append(path)
    for pkg in [OUT_DIR, *(d for d in OUT_DIR.rglob("*") if d.is_dir())]:
        (pkg / "__init__.py").touch()
    # Lets `make` skip regeneration when protos did not change.
    (OUT_DIR / ".stamp").write_text("\n".join(str(p) for p in protos))
    return written


if __name__ == "__main__":
    files = generate()
    print(f"generated {len(files)} files in {OUT_DIR.relative_to(ROOT)}")
