#!/usr/bin/env bash
# The long part of issue 26 in one resumable run: regenerate the default target's responses, cache
# the features of target layers 2, 15, 27 and the final state, train the DFlash-shaped block drafter
# and the EAGLE-3 drafter on them, and record both budget profiles.
#
#   nohup bash scripts/train_export_drafters.sh [WORK_DIR] > train_export.log 2>&1 &
#
# WORK_DIR (default ~/.cache/specdraft/issue26) holds the data, the feature cache and the
# checkpoints, outside the work tree.  Every step resumes: the data build continues at its first
# missing shard, the feature cache skips written shards, the trainers resume from OUT.resume.safetensors,
# and a step whose output is complete is skipped.  Re-run the same command after an interruption.
# Hours on 2 CPU cores (the full build alone is about an hour); run nothing else heavy beside it.
# DFLASH_STEPS (default 1800, the shipped block's recipe) and EAGLE3_EPOCHS (default 4) shorten the
# two trainings; the shipped dflash and eagle3 weights were made with DFLASH_STEPS=900 EAGLE3_EPOCHS=2.
#
# Then: scripts/llamacpp_drafter_check.py --format dflash --drafter WORK_DIR/dflash.safetensors and
# --drafter WORK_DIR/eagle3.safetensors (see docs/export.md).
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-$HOME/.cache/specdraft/issue26}
SD=${SPECDRAFT:-.venv/bin/specdraft}
PREC=${PRECISION:-fast}
mkdir -p "$W"
step() { echo "== $(date '+%H:%M:%S') $*"; }

step "data build"  # resumable; a finished build only re-reads its manifest
"$SD" data build --out "$W/data" --precision "$PREC"

step "features 2,15,27,-1"  # skips the shards already cached
"$SD" data features --data "$W/data" --layers 2,15,27,-1 --out "$W/feat" --precision "$PREC"

# train NAME ARGS...: train W/NAME.safetensors (resumes), then its budget profile; each done once
train() {
  local name=$1; shift
  if [[ ! -f "$W/$name.safetensors" ]]; then
    step "train $name"
    "$SD" train "$@" --data "$W/data" --features "$W/feat" --out "$W/$name.safetensors" --precision "$PREC"
  fi
  if [[ ! -f "$W/$name.profiled" ]]; then
    step "train profile $name"
    "$SD" train profile "$W/$name.safetensors" --data "$W/data" --max-seqs 16 --precision "$PREC"
    touch "$W/$name.profiled"
  fi
}
train dflash block --dflash --draft-vocab 0 --layers 2,15,27 --steps "${DFLASH_STEPS:-1800}"
train eagle3 eagle3 --epochs "${EAGLE3_EPOCHS:-4}"
step "done: $W/dflash.safetensors $W/eagle3.safetensors"
