#!/usr/bin/env bash
# The same call's Xeon, to tell the machine from the code: its compute and memory ceilings now, then the
# per-op profile of INT8 evaluation (tiny batch 64, integer decoder; mini batch 64) at 16 threads and
# at 1. Repository root, $OUT set.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
bash gpu-bundle/run.sh machine-ceiling --threads 16 --fma-seconds 0.3 --no-pairs > $OUT/ceiling.log 2>&1
cat $OUT/ceiling.log | tail -12
B="bash gpu-bundle/run.sh train-step-bench"
for t in 16 1; do
  OMP_NUM_THREADS=$t $B --presets tiny --batches 64 --modes fp32,int8-decoder --steps 5 --warmup 2 --profile \
    > $OUT/profile-tiny-int8-t$t.log 2>&1
  OMP_NUM_THREADS=$t $B --presets mini --batches 64 --modes int8 --steps 3 --warmup 1 --profile \
    > $OUT/profile-mini-int8-t$t.log 2>&1
  grep -E "^(tiny|mini) " $OUT/profile-*-int8-t$t.log
done
