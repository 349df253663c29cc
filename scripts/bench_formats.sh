#!/usr/bin/env bash
# specdraft beside llama-server on the default model requantized to the five common block formats
# (scripts/requantize_default.sh): plain greedy tok/s on the same prompts, and ngram / phrase exact_match.
#
#   bash scripts/bench_formats.sh [OUT_DIR] [N] [MAX_NEW] [DATASET...]
#
# Defaults: OUT_DIR docs/results/formats, N=4 prompts a dataset, MAX_NEW=128 tokens, datasets gsm mtbench
# humaneval (or prompt files, e.g. docs/prompts/fresh2_chat.jsonl).  `phrase` loads on each file without a
# flag (the same model requantized).  One `specdraft bench` per file, in turn (never two at once on a small
# machine); results.json per type.
set -euo pipefail
OUT=${1:-docs/results/formats}
N=${2:-4}
MAX_NEW=${3:-128}
shift $(( $# < 3 ? $# : 3 ))
DATASETS=("$@")
[[ $# -eq 0 ]] && DATASETS=(gsm mtbench humaneval)
DS=()
for d in "${DATASETS[@]}"; do DS+=(--dataset "$d"); done
PY=${PYTHON:-.venv/bin/python}
BIN=$(bash "$(dirname "$0")/build_llamacpp.sh" | tail -1)
for f in $(bash "$(dirname "$0")/requantize_default.sh"); do
  t=$(basename "$f" .gguf); t=${t##*.}
  "$(dirname "$PY")/specdraft" prepare --target "$f" >/dev/null  # packed weights and the cost curve, once per file
  "$(dirname "$PY")/specdraft" bench --target "$f" --llama-cpp "$BIN" --no-hf --no-llamacpp-ngram \
    --drafter none --drafter ngram --drafter phrase \
    "${DS[@]}" --n "$N" --max-new-tokens "$MAX_NEW" --quiet --out "$OUT/$t"
done
