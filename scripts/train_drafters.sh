#!/usr/bin/env bash
# Every shipped drafter of the default target, retrained in one resumable run: regenerate the target's
# responses in the fast precision mode (the mode the drafters serve), cache the features of target
# layers 2, 15, 27 and the final state (one cache that every drafter reads), train each drafter on its
# recipe (specdraft/weights/README.md), then measure its budget profile on the held-out split.
#
#   nohup bash scripts/train_drafters.sh [WORK_DIR] [NAME ...] > train.log 2>&1 &
#
# NAME: phrase gumiho mfd eagle3 medusa eagle block dflash (default: all, in that order: the seeds'
# drafters first).  WORK_DIR (default ~/.cache/specdraft/drafters) holds the data, the feature cache
# and the checkpoints, outside the work tree.  Every step resumes: the data build continues at its first
# missing shard, the feature cache skips written shards, the trainers resume from OUT.resume.safetensors,
# and a step whose output is complete is skipped; re-run the same command after an interruption.  The
# fast mode is bit-exact, so a build on another machine gives the same responses.  Hours on 2 CPU
# cores (build ~35-45 min, features ~20-40 min, the eight trainings ~5 h); run nothing else heavy beside it:
# the profile step times the drafting, and on shared cores it measures the sharing (re-run `specdraft train
# profile CKPT --data WORK/data --max-seqs 16` alone then; phrase's read 1.9-3.2 ms beside a test run, 0.5 alone).
#
# Then copy WORK_DIR/NAME.safetensors to specdraft/weights/NAME_smollm2_135m.safetensors, and check the
# exportable two with scripts/llamacpp_drafter_check.py (docs/export.md).
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-$HOME/.cache/specdraft/drafters}
shift || true
NAMES=("$@")
[[ ${#NAMES[@]} -gt 0 ]] || NAMES=(phrase gumiho mfd eagle3 medusa eagle block dflash)
SD=${SPECDRAFT:-.venv/bin/specdraft}
PREC=${PRECISION:-fast}
LAYERS=2,15,27  # the target layers the drafters fuse; EAGLE-3's default for a 30-layer target
mkdir -p "$W"
step() { echo "== $(date '+%H:%M:%S') $*"; }

step "data build"  # resumable; a finished build only re-reads its manifest
"$SD" data build --out "$W/data" --precision "$PREC"

step "features $LAYERS,-1"  # skips the shards already cached
"$SD" data features --data "$W/data" --layers "$LAYERS,-1" --out "$W/feat" --precision "$PREC"

# block and mfd draft a block of 5 (the root + 4 positions), not 8: chains of 7 accepted 1.27-1.66 tokens a pass
# (docs/export.md) and the CPU budgets are <= 4-6 nodes, so positions 5-7 were almost never reached; the fused step
# already skips their W_o and MLP at budget 4, so what the smaller block saves is only their K/V and keys.
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
for name in "${NAMES[@]}"; do
  case $name in
    phrase) train phrase phrase --vocab-size 8000 --epochs 4 ;;
    gumiho) train gumiho hybrid --serial 2 --parallel 5 --serial-layers 2 --head-blocks 1 --head-grad 0 --distill 1.0 \
              --feature-loss 1.0 --layers "$LAYERS,-1" --width 256 ;;  # the shipped shape; the shipped weights were
              # trained on the broad mix (docs/training.md, "Narrow drafters"), not on this script's data
    medusa) train medusa hybrid --serial 0 --parallel 7 --distill 1.0 --layers "$LAYERS,-1" ;;
    eagle) train eagle hybrid --serial 7 --parallel 0 --distill 1.0 --layers "$LAYERS,-1" ;;
    eagle3) train eagle3 eagle3 --epochs 4 ;;
    block) train block block --modes 1 --block-size 5 --layers "$LAYERS" --steps 1800 --width 256 ;;  # as mfd
    mfd) train mfd block --modes 4 --block-size 5 --layers "$LAYERS" --steps 1800 --width 256 ;;  # the shipped shape,
              # trained on the broad mix (docs/training.md, "Narrow drafters"), not on this script's data
    dflash) train dflash block --dflash --draft-vocab 0 --draft-rows 8192 --layers "$LAYERS" --steps 1800 ;;
    *) echo "unknown drafter $name (phrase gumiho mfd eagle3 medusa eagle block dflash)"; exit 2 ;;
  esac
done
step "done: ${NAMES[*]} in $W"
