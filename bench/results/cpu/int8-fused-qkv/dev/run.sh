#!/usr/bin/env bash
# The development machine (2 cores): INT8 evaluation with Q, K and V fused (int8) and separate
# (int8-separate), FP32 beside them, batch 64, two repetitions. From the repository root after
# `bash scripts/build.sh`: bash bench/results/cpu/int8-fused-qkv/dev/run.sh bench/results/cpu/int8-fused-qkv/dev
set -euo pipefail
out=${1:?output folder}
for rep in 1 2; do
  OMP_NUM_THREADS=2 build/bench/train-step-bench --presets tiny,mini --batches 64 --modes fp32,int8,int8-separate \
    --steps 7 --warmup 2 > "$out/int8-t2-rep$rep.log" 2>&1
  grep -E "^(tiny|mini)" "$out/int8-t2-rep$rep.log" | sed "s/^/rep$rep /"
done
