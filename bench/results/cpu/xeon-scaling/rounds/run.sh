#!/usr/bin/env bash
# Scaling efficiency on the Xeon measured in one process, 1 and 16 threads alternating (train-step-bench
# --scaling-rounds), FP32 batch 128 and 32, tiny and mini; then tiny's per-op profile at 1 and 16 threads.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128,32 --modes fp32 \
  --steps 3 --warmup 2 --scaling-rounds 5 --json $OUT/rounds.json > $OUT/rounds.log 2>&1; cat $OUT/rounds.log
for t in 1 16; do
  OMP_NUM_THREADS=$t bash gpu-bundle/run.sh train-step-bench --presets tiny --batches 128 --modes fp32 \
    --steps 3 --warmup 1 --profile-shapes > $OUT/profile-tiny-t$t.log 2>&1
done
