#!/usr/bin/env bash
# The default target requantized by llama.cpp's own llama-quantize into the block formats people
# download (Q4_0, Q4_K_M, Q5_K_M, Q6_K, Q8_0), for benchmarking the fast kernels on them:
#
#   bash scripts/requantize_default.sh [OUT_DIR]     # default OUT_DIR: ~/.cache/specdraft/requantized
#
# Needs llama-quantize (bash scripts/build_llamacpp.sh builds it; SPECDRAFT_LLAMACPP as there).  The
# source is the shipped Q4_1 file, so every weight is requantized from Q4_1 values (--allow-requantize):
# the files are for speed and losslessness checks, not for quality.  Prints one path a line.
set -euo pipefail
OUT=${1:-$HOME/.cache/specdraft/requantized}
PY=${PYTHON:-.venv/bin/python}
BIN=$(bash "$(dirname "$0")/build_llamacpp.sh" | tail -1)
SRC=$("$PY" -c "from specdraft.model.load import default_gguf_path; print(default_gguf_path())")
mkdir -p "$OUT"
for t in Q4_0 Q4_K_M Q5_K_M Q6_K Q8_0; do
  dst="$OUT/SmolLM2-135M-Instruct.$t.gguf"
  if [[ ! -s "$dst" ]]; then
    "$BIN/llama-quantize" --allow-requantize "$SRC" "$dst.tmp" "$t" >"$OUT/$t.log" 2>&1 \
      || { echo "requantize: llama-quantize $t failed, see $OUT/$t.log" >&2; exit 1; }
    mv "$dst.tmp" "$dst"
  fi
  echo "$dst"
done
