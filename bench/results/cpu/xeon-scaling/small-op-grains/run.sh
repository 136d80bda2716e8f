#!/usr/bin/env bash
# Row-wise ops sized by their rows' length before they wake threads (cross-entropy, row argmax, distillation,
# gather_rows: core/parallel.h rows_per_thread), against the bundle before that change, on the GPU machine's
# Xeon: three rounds alternating the two bundles; each round train-step-bench tiny and mini, batch 32 and 64,
# FP32 training and evaluation and INT8 evaluation with the integer decoder at 16 threads, then tiny b32's
# scaling rounds. From the repository root with $OUT set; carried: gpu-bundle.tar.xz (after) and
# cache/before/gpu-bundle.tar.xz (before).
set -uo pipefail
mkdir -p after before
tar -C after -xJf gpu-bundle.tar.xz
tar -C before -xJf cache/before/gpu-bundle.tar.xz
export OMP_WAIT_POLICY=passive OMP_NUM_THREADS=16
for round in 1 2 3; do
  for which in before after; do
    bash $which/gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 32,64 --modes fp32,int8-decoder \
      --steps 5 --warmup 2 2>&1 | grep -E "^tiny|^mini" | sed "s/^/$round $which /"
  done
done
for which in before after; do
  bash $which/gpu-bundle/run.sh train-step-bench --presets tiny --batches 32 --modes fp32 --steps 5 --warmup 2 \
    --scaling-rounds 3 2>&1 | grep -i -E "scaling|round" | sed "s/^/$which /"
done
OMP_NUM_THREADS=16 bash after/gpu-bundle/run.sh train-step-bench --presets tiny --batches 64 --modes int8-decoder \
  --steps 3 --warmup 1 --profile > "$OUT/profile-after-t16.log" 2>&1
