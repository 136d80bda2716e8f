#!/usr/bin/env bash
# Evaluation with the MLM decoder's logits (the baseline) against its loss and top predictions made tile by
# tile without them, alternating, two repetitions; then bench/int8_eval.sh (bert-eval --int8 end to end).
# Usage: bash bench/results/cpu/int8-inference/scores-without-logits/run.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/../../../../.."
OUT=${1:-/tmp/scores-without-logits}
mkdir -p "$OUT"
for rep in 1 2; do
  for outputs in logits scores; do
    ./build/bench/train-step-bench --presets tiny,mini --batches 64 --modes fp32,int8,int8-decoder --steps 5 \
      --warmup 2 --eval-outputs "$outputs" 2>&1 | tee "$OUT/train-step-bench.$outputs.$rep.log"
  done
done
PRESETS="tiny mini" bash bench/int8_eval.sh "$OUT/int8-eval"
