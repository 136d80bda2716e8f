#!/usr/bin/env bash
# Thread scaling on the Xeon, passive waiting: FP32 step at 1, 4, 8, 16 threads, tiny and mini b128.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
for policy in OMP_WAIT_POLICY=passive GOMP_SPINCOUNT=300000; do
  for t in 1 4 8 16; do
    echo "== $policy threads $t"
    env $policy OMP_NUM_THREADS=$t bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 \
      --steps 3 --warmup 1 2>&1 | grep -E "^(tiny|mini) "
  done
done
