#!/usr/bin/env bash
# Build llama.cpp's own OpenAI-compatible server (llama-server) for bench/serving.py, and f32 and
# bf16 GGUFs of the default checkpoint so llama.cpp runs the same weights at the same precision as
# llm-mesh. The package registry carries no llama.cpp binary, but the llama-cpp-python sdist
# vendors the llama.cpp sources (tools/server included): this builds the C++ server from them,
# statically, into bench/.peers/ (git-ignored). ~10 minutes on 2 cores; run once.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PEERS=bench/.peers
mkdir -p "$PEERS/src"
if [ ! -d "$PEERS/src/llama_cpp_python-$VERSION" ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PEERS/src"
  tar xzf "$PEERS/src/llama_cpp_python-$VERSION.tar.gz" -C "$PEERS/src"
fi
LLAMA="$PEERS/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -x "$PEERS/llama-server" ]; then
  cmake -S "$LLAMA" -B "$LLAMA/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DGGML_NATIVE=ON
  cmake --build "$LLAMA/build" --target llama-server -j "$(nproc)"
  cp "$LLAMA/build/bin/llama-server" "$PEERS/llama-server"
fi
# One GGUF per precision bench/serving.py runs at (--dtype float32 | bfloat16).
for outtype in f32 bf16; do
  if [ ! -f "$PEERS/SmolLM2-135M-Instruct.$outtype.gguf" ]; then
    # The converter tries sentencepiece before the BPE vocab SmolLM2 has; it needs the module importable.
    "$PY" -m pip install -q sentencepiece
    HF_HUB_OFFLINE=1 PYTHONPATH="$LLAMA/gguf-py" "$PY" "$LLAMA/convert_hf_to_gguf.py" \
      models/SmolLM2-135M-Instruct --outtype "$outtype" --outfile "$PEERS/SmolLM2-135M-Instruct.$outtype.gguf"
  fi
done
"$PEERS/llama-server" --version 2>&1 | head -2
