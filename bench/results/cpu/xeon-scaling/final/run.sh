#!/usr/bin/env bash
# The final code on the Xeon: INT8 evaluation (integer encoder, and with the integer MLM decoder) against
# FP32 at 16 threads; scaling in alternating rounds; tiny's per-op profile at 16 threads; the GPU tests.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
B="bash gpu-bundle/run.sh train-step-bench"
OMP_NUM_THREADS=16 $B --presets tiny,mini --batches 64 --modes fp32,int8,int8-decoder --steps 5 --warmup 2 \
  > $OUT/int8.log 2>&1; grep -E "^(tiny|mini) " $OUT/int8.log
OMP_NUM_THREADS=16 $B --presets tiny,mini --batches 128,32 --modes fp32 --steps 3 --warmup 2 --scaling-rounds 5 \
  --json $OUT/rounds.json > $OUT/rounds.log 2>&1; grep -E "^(tiny|mini) |scaling" $OUT/rounds.log
OMP_NUM_THREADS=16 $B --presets tiny --batches 128 --modes fp32 --steps 5 --warmup 2 --profile-shapes \
  > $OUT/profile-tiny-t16.log 2>&1
bash gpu-bundle/run.sh tests > $OUT/gpu-tests.log 2>&1; grep -E "PASSED|FAILED|SKIPPED|tests ran" $OUT/gpu-tests.log
