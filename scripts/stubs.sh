#!/usr/bin/env bash
# Client stubs for the llm-mesh API in another language, with plain protoc / grpc_tools.
#
#   scripts/stubs.sh python|go|java OUT_DIR        (or: make stubs LANG=… [OUT=…])
#
# protos/llmmesh/v1/router.proto imports google/api/annotations.proto (the REST mapping the
# gateway reads), which protoc does not ship. This script first bundles protos/ with the two
# Google API files it needs into OUT_DIR/proto/, so that one -I flag resolves every import,
# then runs the generator for LANG into OUT_DIR/LANG/. docs/clients.md shows how to use them.
set -euo pipefail

usage() { echo "usage: scripts/stubs.sh python|go|java OUT_DIR" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
LANGUAGE="$1"
OUT="$(mkdir -p "$2" && cd "$2" && pwd)"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3

die() { echo "stubs: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || die "$1 not found: $2"; }

# --- the bundle: protos/ + google/api/{annotations,http}.proto (from googleapis-common-protos,
# or Debian's grpc-gateway copy of googleapis when that Python package is not installed).
BUNDLE="$OUT/proto"
rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/google/api"
cp -r "$ROOT/protos/llmmesh" "$BUNDLE/"
GOOGLE_API="$("$PYTHON" -c 'import google.api, pathlib; print(pathlib.Path(list(google.api.__path__)[0]))' 2>/dev/null || true)"
[[ -f "$GOOGLE_API/annotations.proto" ]] ||
  GOOGLE_API=/usr/share/gocode/src/github.com/grpc-ecosystem/grpc-gateway/third_party/googleapis/google/api
[[ -f "$GOOGLE_API/annotations.proto" ]] ||
  die "google/api/annotations.proto not found: pip install googleapis-common-protos (or apt-get install golang-github-grpc-ecosystem-grpc-gateway-dev)"
cp "$GOOGLE_API/annotations.proto" "$GOOGLE_API/http.proto" "$BUNDLE/google/api/"
mapfile -t PROTOS < <(cd "$BUNDLE" && ls llmmesh/v1/*.proto)

# Rewrites proto3 `optional T x = N;` as `oneof _x { T x = N; }`: the synthetic oneof protoc itself
# makes for it (same wire format and JSON name, presence kept), for generators that predate
# `optional`, which protoc 3.21 refuses to feed such files. Used for Debian's protoc-gen-go 1.3.
OPTIONAL_RE='^([[:space:]]*)optional[[:space:]]+([A-Za-z0-9_.]+)[[:space:]]+([A-Za-z0-9_]+)[[:space:]]*=[[:space:]]*([0-9]+)[[:space:]]*;'
without_optional() {
  local dir="$1" proto
  for proto in "$dir"/llmmesh/v1/*.proto; do
    sed -E -i "s/$OPTIONAL_RE/\\1oneof _\\3 { \\2 \\3 = \\4; }/" "$proto"
  done
}

case "$LANGUAGE" in
python)
  "$PYTHON" -c 'import grpc_tools' 2>/dev/null || die "grpc_tools not importable by $PYTHON: pip install grpcio-tools"
  DEST="$OUT/python" && rm -rf "$DEST" && mkdir -p "$DEST"
  WKT="$("$PYTHON" -c 'import grpc_tools, pathlib; print(pathlib.Path(grpc_tools.__file__).parent / "_proto")')"
  (cd "$BUNDLE" && "$PYTHON" -m grpc_tools.protoc -I . -I "$WKT" \
    --python_out="$DEST" --pyi_out="$DEST" --grpc_python_out="$DEST" "${PROTOS[@]}")
  touch "$DEST/llmmesh/__init__.py" "$DEST/llmmesh/v1/__init__.py"
  echo "stubs: python → $DEST (import llmmesh.v1.router_pb2; needs grpcio, protobuf, googleapis-common-protos)"
  ;;
go)
  need protoc "apt-get install protobuf-compiler"
  need protoc-gen-go "apt-get install golang-goprotobuf-dev (Debian's protoc-gen-go 1.3, with the grpc plugin built in)"
  DEST="$OUT/go" && rm -rf "$DEST" && mkdir -p "$DEST/src"
  GO_BUNDLE="$OUT/proto-go" && rm -rf "$GO_BUNDLE" && cp -r "$BUNDLE" "$GO_BUNDLE"
  without_optional "$GO_BUNDLE"
  # The shared protos leave go_package to each language: map every file to one Go package.
  GO_PKG=llmmesh/v1
  MAP="Mgoogle/api/annotations.proto=google.golang.org/genproto/googleapis/api/annotations"
  for proto in "${PROTOS[@]}"; do MAP="$MAP,M$proto=$GO_PKG;llmmeshv1"; done
  (cd "$GO_BUNDLE" && protoc -I . -I /usr/include --go_out="plugins=grpc,$MAP:$DEST/src" "${PROTOS[@]}")
  rm -rf "$GO_BUNDLE"
  echo "stubs: go → $DEST/src/$GO_PKG (package llmmeshv1, import \"$GO_PKG\"; GOPATH=$DEST:/usr/share/gocode GO111MODULE=off)"
  ;;
java)
  need protoc "apt-get install protobuf-compiler"
  DEST="$OUT/java" && rm -rf "$DEST" && mkdir -p "$DEST"
  GRPC=()
  # Debian's protobuf-compiler-grpc-java-plugin installs it as grpc_java_plugin.
  PLUGIN="$(command -v protoc-gen-grpc-java || command -v grpc_java_plugin || true)"
  if [[ -n "$PLUGIN" ]]; then
    GRPC=(--plugin=protoc-gen-grpc-java="$PLUGIN" --grpc-java_out="$DEST")
  else
    echo "stubs: protoc-gen-grpc-java not found (apt-get install protobuf-compiler-grpc-java-plugin): messages only" >&2
  fi
  (cd "$BUNDLE" && protoc -I . -I /usr/include --java_out="$DEST" "${GRPC[@]}" "${PROTOS[@]}" google/api/annotations.proto google/api/http.proto)
  echo "stubs: java → $DEST (package llmmesh.v1; needs protobuf-java${PLUGIN:+, grpc-java})"
  ;;
*) usage ;;
esac
