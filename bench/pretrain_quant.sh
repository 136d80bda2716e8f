#!/usr/bin/env bash
# The CPU accuracy benchmark (bench/README.md, "CPU: pretraining the tiny preset"): evaluates an FP32 pretraining run on the held-out
# documents and on Brown, compares PTQ calibrators, runs a short QAT from it, evaluates that, runs the
# sensitivity analysis, and times FP32 and QAT training steps. Needs `bash scripts/demo_data.sh` and an
# FP32 run, e.g.:
#   ./build/tools/bert-train --train cache/data/shards/train --eval cache/data/shards/heldout \
#     --tokenizer cache/data/spm.model --out runs/tiny-2000 --preset tiny --steps 2000 --batch-size 128 \
#     --lr 1e-3 --warmup 0.1 --dropout 0.1 --seed 1 --eval-every 500 --eval-batches 0
# Usage: bash bench/pretrain_quant.sh [FP32_RUN_DIR] [QAT_STEPS]   (defaults: runs/tiny-2000, 200)
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/tiny-2000}
QAT_STEPS=${2:-200}
B=./build/tools
D=cache/data/shards
OUT=$RUN/bench
mkdir -p "$OUT"
echo "== FP32 on held-out training documents (in-domain; NSP is judged here)"
$B/bert-eval --checkpoint "$RUN" --shards $D/heldout --json-out "$OUT/fp32_heldout.json"
echo "== FP32 on Brown (another genre)"
$B/bert-eval --checkpoint "$RUN" --shards $D/brown --json-out "$OUT/fp32_brown.json"
for set in heldout brown; do
  echo "== FP32 vs PTQ (each calibrator; 16 calibration batches of training data) on $set"
  $B/bert-eval --checkpoint "$RUN" --shards $D/$set --compare --calib-shards $D/train --calib-batches 16 \
    --json-out "$OUT/ptq_$set.json"
done
echo "== QAT: $QAT_STEPS steps from the FP32 checkpoint (percentile 99.99 init, lr 1e-4, scales x10)"
rm -rf "$RUN-qat"
/usr/bin/time -f "QAT wall %e s, max RSS %M KB" $B/bert-train --init-from "$RUN/checkpoint.h5" --qat \
  --calibrator percentile --calib-batches 16 --train $D/train --eval $D/heldout --tokenizer "$RUN/tokenizer.model" \
  --out "$RUN-qat" --steps "$QAT_STEPS" --batch-size 128 --lr 1e-4 --warmup 0.1 --scale-lr-mult 10 --dropout 0.1 \
  --log-every 50 --eval-every 0 --eval-batches 0 --save-every 0
for set in heldout brown; do
  echo "== FP32 vs PTQ vs QAT on $set"
  $B/bert-eval --checkpoint "$RUN-qat" --shards $D/$set --compare --calib-shards $D/train --calib-batches 16 \
    --json-out "$OUT/qat_$set.json"
done
echo "== Sensitivity (percentile calibrator) on held-out"
$B/bert-eval --checkpoint "$RUN" --shards $D/heldout --sensitivity --calibrator percentile --calib-shards $D/train \
  --calib-batches 16 --max-drop 0.005 --plan-out "$OUT/plan.json" --json-out "$OUT/sensitivity.json" 2>/dev/null
echo "== Training-step speed, FP32 vs QAT"
./build/bench/train-step-bench --presets tiny,mini --batches 32,128 --steps 5 --warmup 2
