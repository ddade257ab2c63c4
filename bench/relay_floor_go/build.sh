#!/usr/bin/env bash
# Builds the Go floor relay (bench/relay_floor_go/bin/llm-mesh-relay-floor-go) offline,
# over the Go stubs the REST gateway's build generates from protos/ (GOPATH mode,
# Debian's Go packages; deploy/gateway/build.sh installs them when missing).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
STUBS="$ROOT/deploy/gateway/build/gopath"
OUT="$HERE/bin/llm-mesh-relay-floor-go"

# The stubs are regenerated whenever a proto is newer than them.
if [[ ! -f "$STUBS/src/llmmesh/gen/llmmeshv1/router.pb.go" ]] ||
  [[ -n "$(find "$ROOT/protos" -name '*.proto' -newer "$STUBS/src/llmmesh/gen/llmmeshv1/router.pb.go")" ]]; then
  bash "$ROOT/deploy/gateway/build.sh"
fi
if [[ -z "${GOCACHE:-}" && -z "${HOME:-}" ]]; then
  export GOCACHE="$HERE/bin/.gocache"
fi
mkdir -p "$(dirname "$OUT")"
cd "$HERE"
GO111MODULE=off GOPROXY=off GOPATH="$STUBS:/usr/share/gocode" CGO_ENABLED=0 \
  go build -trimpath -o "$OUT" .
echo "built $OUT"
