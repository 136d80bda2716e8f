#!/usr/bin/env bash
# Where INT8 evaluation's time goes on the GPU machine's Xeon at 16 threads against 1 (train-step-bench
# --profile, evaluation only; tiny and mini, batch 64): which ops do not scale. From the repository root with
# $OUT set; gpu-bundle.tar.xz carried.
set -uo pipefail
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
export OMP_WAIT_POLICY=passive
for t in 16 1; do
  OMP_NUM_THREADS=$t bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 64 \
    --modes fp32,int8-decoder --steps 3 --warmup 1 --profile > "$OUT/profile-before-t$t.log" 2>&1
  grep -E "^tiny|^mini" "$OUT/profile-before-t$t.log" | sed "s/^/t$t /"
done
