#!/usr/bin/env bash
# FLE's main job, end to end, on a small qwen4exp model that FLE makes itself:
#   make a reference (F32), a base in the releases' mix and two donors with the
#   same weights -> measure per-layer sensitivity -> select layers under a size
#   target -> splice -> score experts (REAP) -> prune -> inspect -> generate.
# Usage: tools/demo.sh [OUT_DIR]   (default out/demo; run tools/setup.sh first)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/demo}
BIN=.venv/bin
ARCH=qwen4exp
MAKE="$BIN/fle-synth $ARCH --seed 0 --routing-skew 2 --force"
EXPERTS='ffn_(gate|up|down)_exps'
mkdir -p "$OUT"

echo "== 1. models: reference (F32), base (release mix), donors with IQ3_S / IQ3_XXS experts"
$MAKE -o "$OUT/ref.gguf" --mix f32 --mtp none
$MAKE -o "$OUT/base.gguf" --mix release
$MAKE -o "$OUT/donor-iq3s.gguf" --mix release --rule "$EXPERTS=IQ3_S" --mtp none
$MAKE -o "$OUT/donor-iq3xxs.gguf" --mix release --rule "$EXPERTS=IQ3_XXS" --mtp none
cat README.md docs/*.md > "$OUT/text.txt"

echo "== 2. sensitivity: relative MoE output error of every donor layer on captured inputs"
$BIN/fle-sensitivity --ref "$OUT/ref.gguf" --base "$OUT/base.gguf" --base-name base \
    --donor IQ3_S="$OUT/donor-iq3s.gguf" --donor IQ3_XXS="$OUT/donor-iq3xxs.gguf" \
    --text "$OUT/text.txt" --tokens 1024 --ctx 512 -o "$OUT/sensitivity.json" --force

echo "== 3. select: least predicted error under a size target halfway between the smallest file and the base"
TARGET=$($BIN/python - "$OUT/sensitivity.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
lo = t["fixed_bytes"] + sum(min(c["expert_bytes"] for c in l["candidates"].values()) for l in t["layers"])
hi = t["fixed_bytes"] + sum(l["candidates"][t["base"]]["expert_bytes"] for l in t["layers"])
print((lo + hi) // 2)
PY
)
$BIN/fle-select --sensitivity "$OUT/sensitivity.json" --target "$TARGET" --step 4kB -o "$OUT/selection.json" --force

echo "== 4. splice the selected expert layers into the base"
$BIN/fle-splice --base "$OUT/base.gguf" --donor IQ3_S="$OUT/donor-iq3s.gguf" \
    --donor IQ3_XXS="$OUT/donor-iq3xxs.gguf" --selection "$OUT/selection.json" -o "$OUT/hybrid.gguf" --force

echo "== 5. REAP scores of every expert (MTP head included), then prune to 6 of 8 experts per layer"
$BIN/fle-reap score "$OUT/hybrid.gguf" --mtp-head "$OUT/base-mtp.gguf" --text "$OUT/text.txt" \
    --tokens 1024 --ctx 512 --method reap -o "$OUT/scores.json" --force
$BIN/fle-reap prune "$OUT/hybrid.gguf" --scores "$OUT/scores.json" --keep 6 -o "$OUT/pruned.gguf" \
    --mtp-head "$OUT/base-mtp.gguf" --mtp-out "$OUT/pruned-mtp.gguf" --force

echo "== 6. inspect and generate"
$BIN/fle-inspect "$OUT/pruned.gguf"
$BIN/fle-engine generate "$OUT/pruned.gguf" --prompt "The experts of a layer" -n 24 --temp 0
