"""Generate llm_mesh_client's protobuf/gRPC modules from the repository's protos/.

Run by the package build (setup.py) and by `make proto`; also runnable by hand:
``python clients/python/stubgen.py [OUT_DIR]``. Nothing generated is committed, so the
client's stubs can never drift from protos/: a wheel built from this tree carries exactly
the contract the servers beside it were built from (and, in one process with the servers'
own ``services.gen`` stubs, both register byte-identical descriptors, which protobuf
accepts as one file).

protoc emits ``from llmmesh.v1 import common_pb2``; the imports are rewritten to
``llm_mesh_client._gen.llmmesh.v1`` so the stubs live inside the package and touch no
top-level name. ``google/api/annotations.proto`` (imported by router.proto) is resolved from
googleapis-common-protos, which also provides ``google.api.annotations_pb2`` at run time.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_DIR = HERE.parents[1] / "protos"
DEFAULT_OUT = HERE / "llm_mesh_client" / "_gen"
PACKAGE = "llm_mesh_client._gen.llmmesh.v1"
IMPORT_RE = re.compile(r"^(from|import) llmmesh\.v1", re.MULTILINE)


def include_dirs() -> list[str]:
    """protoc include paths: ours, grpc_tools' well-known types, googleapis' google/api."""
    import google.api
    import grpc_tools

    return [
        str(PROTO_DIR),
        str(Path(grpc_tools.__file__).parent / "_proto"),
        str(Path(next(iter(google.api.__path__))).parents[1]),
    ]


def generate(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """Write the stubs (and .pyi typing stubs when mypy-protobuf is installed) into ``out_dir``."""
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.rglob("*.proto"))
    if not protos:
        raise SystemExit(f"stubgen: no .proto files under {PROTO_DIR} (build from the repository)")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    args = ["grpc_tools.protoc", *(f"-I{d}" for d in include_dirs())]
    args += [f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    plugin = shutil.which("protoc-gen-mypy") or str(Path(sys.executable).parent / "protoc-gen-mypy")
    if Path(plugin).exists():
        args += [
            f"--plugin=protoc-gen-mypy={plugin}",
            f"--plugin=protoc-gen-mypy_grpc={Path(plugin).parent / 'protoc-gen-mypy_grpc'}",
            f"--mypy_out={out_dir}",
            f"--mypy_grpc_out={out_dir}",
        ]
    else:
        # protoc's own typing stubs (messages only) when mypy-protobuf is not installed: a wheel built
        # in pip's isolated environment still ships typed messages (py.typed).
        args += [f"--pyi_out={out_dir}"]
    args += [str(p.relative_to(PROTO_DIR)) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("stubgen: protoc failed")
    written = []
    for path in out_dir.rglob("*"):
        if path.suffix in (".py", ".pyi"):
            path.write_text(IMPORT_RE.sub(rf"\1 {PACKAGE}", path.read_text()))
            written.append(path)
    for package in [out_dir, *(d for d in out_dir.rglob("*") if d.is_dir())]:
        (package / "__init__.py").touch()
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    print(f"stubgen: {len(generate(target))} files in {target}")
