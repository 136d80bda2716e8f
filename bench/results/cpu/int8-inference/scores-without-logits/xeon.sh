#!/usr/bin/env bash
# The GPU machine's Xeon, 16 threads: evaluation with the MLM decoder's logits against its loss and top
# predictions made without them (train-step-bench --eval-outputs), FP32 and INT8, three rounds alternating.
# From the repository root; gpu-bundle.tar.xz (scripts/gpu_bundle.sh) carried.
set -uo pipefail
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
export OMP_NUM_THREADS=16 OMP_WAIT_POLICY=passive
for round in 1 2 3; do
  for outputs in logits scores; do
    bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 64 --modes fp32,int8,int8-decoder \
      --steps 5 --warmup 2 --eval-outputs $outputs 2>&1 | grep -E "^tiny|^mini" | sed "s/^/$round $outputs /"
  done
done
