#!/usr/bin/env bash
# specdraft beside llama-server on the default model requantized to the five common block formats
# (scripts/requantize_default.sh): plain greedy tok/s on the same prompts, and ngram / phrase exact_match.
#
#   bash scripts/bench_formats.sh [OUT_DIR] [N]     # default OUT_DIR docs/results/formats, N=4 prompts a dataset
#
# One `specdraft bench` per file, in turn (never two at once on a small machine); results.json per type.
set -euo pipefail
OUT=${1:-docs/results/formats}
N=${2:-4}
PY=${PYTHON:-.venv/bin/python}
BIN=$(bash "$(dirname "$0")/build_llamacpp.sh" | tail -1)
for f in $(bash "$(dirname "$0")/requantize_default.sh"); do
  t=$(basename "$f" .gguf); t=${t##*.}
  "$(dirname "$PY")/specdraft" bench --target "$f" --llama-cpp "$BIN" --no-hf --no-llamacpp-ngram \
    --drafter none --drafter ngram --drafter phrase@any_target=1 \
    --dataset gsm --dataset mtbench --dataset humaneval --n "$N" --max-new-tokens 128 --quiet --out "$OUT/$t"
done
