#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench, llama-quantize and llama-completion natively from the llama-cpp-python source
# distribution (a package-registry download), for `specdraft bench --llama-cpp BIN_DIR`.
#
#   bash scripts/build_llamacpp.sh [OUT_DIR]      # default OUT_DIR: ~/.cache/specdraft/llamacpp
#
# About 8 minutes on 2 cores; cached (a second run with the binaries present does nothing).
# Prints the folder holding the binaries on its last line.  Needs cmake and a C++ compiler.
set -euo pipefail
VERSION=0.3.36
OUT=${1:-${SPECDRAFT_LLAMACPP:-$HOME/.cache/specdraft/llamacpp}}
BIN="$OUT/build/bin"
if [[ -x "$BIN/llama-server" && -x "$BIN/llama-bench" && -x "$BIN/llama-quantize" && -x "$BIN/llama-completion" ]]; then
  echo "$BIN"
  exit 0
fi
command -v cmake >/dev/null || { echo "build_llamacpp: cmake not found" >&2; exit 1; }
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [[ ! -d "$OUT/src" ]]; then
  rm -rf "$OUT/dl"
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$OUT/dl"
  mkdir -p "$OUT/unpack"
  tar -xzf "$OUT"/dl/llama_cpp_python-"$VERSION".tar.gz -C "$OUT/unpack"
  mv "$OUT/unpack/llama_cpp_python-$VERSION/vendor/llama.cpp" "$OUT/src"
  rm -rf "$OUT/unpack" "$OUT/dl"
fi
cmake -S "$OUT/src" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$OUT/cmake.log" 2>&1 \
  || { echo "build_llamacpp: cmake configure failed, see $OUT/cmake.log" >&2; exit 1; }
cmake --build "$OUT/build" -j "$(nproc)" --target llama-server llama-bench llama-quantize llama-completion >"$OUT/build.log" 2>&1 \
  || { echo "build_llamacpp: the build failed, see $OUT/build.log" >&2; exit 1; }
echo "$BIN"
