#!/usr/bin/env bash
# The broad training mix of the default target (or TARGET), built part by part until it holds
# TOKENS response tokens, plus a held-out part from sources no training part uses:
#
#   nohup bash scripts/build_mix.sh [WORK_DIR] [TOKENS] > mix.log 2>&1 &
#
# WORK_DIR (default ~/.cache/specdraft/mix) gets part_00, part_01, ... and heldout: each one
# `specdraft data build --sources mix` with its own seed (other gsm problems, other sampled prompts),
# excluding every earlier part's prompts, a quarter of its responses sampled at T=0.7.  Everything
# resumes: re-run the same command after an interruption and the build continues at the current part's
# first missing shard (a part whose prompts are being collected starts that collection again).  Each
# part keeps the hidden states of target layers LAYERS as it decodes (PART/features, what `data features`
# would compute, bit for bit, with no extra pass: 3-4 GB a part).  The
# fast mode is bit-exact, so a part built on another machine is the same data.  On 2 Zen 3 cores (AVX2)
# part_00 (2,000 prompts, 256 new tokens) took 47 minutes: 17 collecting prompts, 30 regenerating
# 334,201 response tokens; the trainers take the parts as repeated `--data` folders.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-$HOME/.cache/specdraft/mix}
TOKENS=${2:-4000000}
SD=${SPECDRAFT:-.venv/bin/specdraft}
TARGET=${TARGET:-default}
PROMPTS=${PROMPTS:-2000}
LAYERS=${LAYERS:-2,15,27,-1}  # hidden states kept while decoding (the shipped drafters' feature layers)
MAX_NEW=${MAX_NEW:-384}  # part_00 was built with 256: 53-65% of its chat and code answers reached it
mkdir -p "$W"
tokens() {  # response tokens written so far in a data folder (0 if it has no manifest yet)
  python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['response_tokens'])" "$1/manifest.json" 2>/dev/null || echo 0
}
complete() {  # whether a data folder has written all its shards
  python3 - "$1" <<'PY' 2>/dev/null
import json, sys
m = json.load(open(sys.argv[1] + "/manifest.json"))
n = sum(1 for line in open(sys.argv[1] + "/prompts.jsonl") if line.strip())
sys.exit(0 if sum(s["sequences"] for s in m["shards"]) == n else 1)
PY
}
# the held-out part first: it is small, and every later measurement needs it
[[ -d "$W/heldout" ]] && complete "$W/heldout" || \
  "$SD" data build --target "$TARGET" --precision fast --out "$W/heldout" --sources mix --split heldout \
    --seed 9001 --n-prompts 400 --sampled 0.25
p=0
while :; do
  dir=$(printf "%s/part_%02d" "$W" "$p")
  total=0
  for d in "$W"/part_*; do [[ -d "$d" && "$d" != "$dir" ]] && total=$((total + $(tokens "$d"))); done
  if [[ -d "$dir" ]] && complete "$dir"; then p=$((p + 1)); continue; fi
  if [[ ! -d "$dir" ]] && (( total >= TOKENS )); then break; fi
  excl=()
  for ((q = 0; q < p; q++)); do excl+=(--exclude "$(printf "%s/part_%02d" "$W" "$q")"); done
  excl+=(--exclude "$W/heldout")
  "$SD" data build --target "$TARGET" --precision fast --out "$dir" --sources mix --seed $((2001 + p)) \
    --magpie-seed $((2001 + p)) --n-prompts "$PROMPTS" --max-new-tokens "$MAX_NEW" --sampled 0.25 \
    --features-layers "$LAYERS" "${excl[@]}"
  p=$((p + 1))
done
echo "mix complete: $total response tokens in $W/part_* (held-out part: $(tokens "$W/heldout"))"
