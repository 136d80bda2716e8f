#!/usr/bin/env bash
# After the quantization loops were dispatched to AVX-512 at run time: the INT8 kernels on one core
# (gemm-bench's second table), then INT8 evaluation against FP32 at 16 and 4 threads. Into $OUT.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
OMP_NUM_THREADS=1 bash gpu-bundle/run.sh gemm-bench --reps 3 > $OUT/gemm-t1.txt 2>&1; grep -A10 "INT8 linear" $OUT/gemm-t1.txt
for t in 16 4; do
  OMP_NUM_THREADS=$t bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 64 \
    --modes fp32,int8,int8-decoder --steps 5 --warmup 2 > $OUT/int8-t$t.log 2>&1
  echo "== $t threads"; grep -E "^(tiny|mini) " $OUT/int8-t$t.log
done
