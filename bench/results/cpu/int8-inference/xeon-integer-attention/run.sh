#!/usr/bin/env bash
# INT8 evaluation on the Xeon with integer attention products: train-step-bench's FP32, INT8 and INT8 with
# the integer decoder, tiny and mini, batch 64, at 16 and 4 threads; then the GPU tests. Into $OUT.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
for t in 16 4; do
  OMP_NUM_THREADS=$t bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 64 \
    --modes fp32,int8,int8-decoder --steps 5 --warmup 2 > $OUT/int8-t$t.log 2>&1
  echo "== $t threads"; grep -E "^(tiny|mini) " $OUT/int8-t$t.log
done
bash gpu-bundle/run.sh tests > $OUT/gpu-tests.log 2>&1; grep -E "PASSED|FAILED|SKIPPED|tests ran" $OUT/gpu-tests.log
