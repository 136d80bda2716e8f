#!/usr/bin/env bash
# The Xeon's own scaling bound (machine-ceiling: FMA chains on registers, a triad over memory, CPU pairs),
# then ours per op at 1 and 16 threads (tiny and mini, FP32, batch 128), into $OUT.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
lscpu | grep -E "Model name|Thread|Core|Socket|MHz" > $OUT/lscpu.txt
bash gpu-bundle/run.sh machine-ceiling --triad-mib 1024 > $OUT/ceiling.txt 2>&1; cat $OUT/ceiling.txt
for t in 1 16; do
  OMP_NUM_THREADS=$t bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 \
    --steps 3 --warmup 1 --profile-shapes > $OUT/ours-t$t.log 2>&1
  grep -E "^(tiny|mini) " $OUT/ours-t$t.log
done
