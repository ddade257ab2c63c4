#!/usr/bin/env bash
# Builds the REST gateway sidecar (deploy/gateway/bin/llm-mesh-gateway) offline,
# the way Debian builds Go programs: Debian's Go packages in GOPATH mode, no
# module proxy. Installs missing Debian packages with apt when run as root.
#
# Generated code is not committed: protoc writes the Go stubs and the
# grpc-gateway handlers into deploy/gateway/build/ on every build, and the
# OpenAPI (Swagger 2.0) spec into deploy/gateway/openapi.json, which main.go
# embeds and serves at /openapi.json.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BUILD="$HERE/build"
OUT="${GATEWAY_BIN:-$HERE/bin/llm-mesh-gateway}"
GOCODE=/usr/share/gocode
GW_SRC="$GOCODE/src/github.com/grpc-ecosystem/grpc-gateway"
GO_PKG=llmmesh/gen/llmmeshv1
PACKAGES=(golang-go golang-grpc-gateway golang-github-grpc-ecosystem-grpc-gateway-dev
  protobuf-compiler libprotobuf-dev)

missing_tools() {
  local tool
  for tool in go protoc protoc-gen-go protoc-gen-grpc-gateway protoc-gen-swagger; do
    command -v "$tool" >/dev/null 2>&1 || echo "$tool"
  done
  [[ -d "$GW_SRC/runtime" ]] || echo "grpc-gateway runtime sources"
  [[ -f /usr/include/google/protobuf/descriptor.proto ]] || echo "protobuf includes"
}

install_packages() {
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || {
      echo "build.sh: missing: $* — install as root: apt-get install -y ${PACKAGES[*]}" >&2
      exit 1
    }
    sudo=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  # A fresh container has no package lists; only refresh them when the install needs it.
  "${sudo[@]}" apt-get install -y --no-install-recommends "${PACKAGES[@]}" ||
    { "${sudo[@]}" apt-get update && "${sudo[@]}" apt-get install -y --no-install-recommends "${PACKAGES[@]}"; }
}

missing="$(missing_tools | paste -sd, -)"
if [[ -n "$missing" ]]; then
  install_packages "$missing"
fi
# Go keeps its build cache under $HOME; CI shells may have none.
if [[ -z "${GOCACHE:-}" && -z "${HOME:-}" ]]; then
  export GOCACHE="$HERE/bin/.gocache"
fi

rm -rf "$BUILD"
mkdir -p "$BUILD/protos-go/llmmesh/v1" "$BUILD/protos-doc/llmmesh/v1" "$BUILD/gopath/src" "$BUILD/swagger" "$(dirname "$OUT")"

# Debian's protoc-gen-go (1.3) and grpc-gateway (1.6) predate proto3 `optional`,
# and protoc refuses to hand such files to them. Two rewritten copies:
#  - for Go, `optional T x = N;` becomes `oneof _x { T x = N; }`, exactly the
#    synthetic oneof protoc makes for it: same wire format, same JSON name, and
#    presence is kept (an explicit `"temperature": 0` still reaches the router);
#  - for the spec, `optional` is dropped so each field keeps its comment.
# Both get a go_package, which the shared protos leave to each language.
OPTIONAL_RE='^([[:space:]]*)optional[[:space:]]+([A-Za-z0-9_.]+)[[:space:]]+([A-Za-z0-9_]+)[[:space:]]*=[[:space:]]*([0-9]+)[[:space:]]*;'
for proto in "$ROOT"/protos/llmmesh/v1/*.proto; do
  name="$(basename "$proto")"
  sed -E -e "s/$OPTIONAL_RE/\\1oneof _\\3 { \\2 \\3 = \\4; }/" \
    -e "s|^package llmmesh.v1;|package llmmesh.v1;\\noption go_package = \"$GO_PKG;llmmeshv1\";|" \
    "$proto" >"$BUILD/protos-go/llmmesh/v1/$name"
  sed -E -e "s/$OPTIONAL_RE/\\1\\2 \\3 = \\4;/" "$proto" >"$BUILD/protos-doc/llmmesh/v1/$name"
done

INCLUDES=(-I "$GW_SRC/third_party/googleapis" -I /usr/include)
(
  cd "$BUILD/protos-go"
  protoc -I . "${INCLUDES[@]}" \
    --go_out=plugins=grpc:"$BUILD/gopath/src" \
    --grpc-gateway_out=logtostderr=true:"$BUILD/gopath/src" \
    llmmesh/v1/*.proto
)
(
  cd "$BUILD/protos-doc"
  protoc -I . "${INCLUDES[@]}" --swagger_out=logtostderr=true:"$BUILD/swagger" llmmesh/v1/router.proto
)
# The generator titles the spec after the file name; give it the API's name.
sed -e 's|"title": "llmmesh/v1/router.proto"|"title": "llm-mesh Router REST API"|' \
  -e 's|"version": "version not set"|"version": "v1"|' \
  "$BUILD/swagger/llmmesh/v1/router.swagger.json" >"$HERE/openapi.json"

# main.go stays outside GOPATH (a local package); its imports resolve from the
# generated code first, then Debian's /usr/share/gocode.
cd "$HERE"
GO111MODULE=off GOPROXY=off GOPATH="$BUILD/gopath:$GOCODE" \
  CGO_ENABLED=0 \
  go build -trimpath -o "$OUT" .
echo "built $OUT"
