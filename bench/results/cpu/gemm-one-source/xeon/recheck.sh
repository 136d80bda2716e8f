#!/usr/bin/env bash
# The same Xeon, a second call after the SpecialValues bound: the GEMM on one thread three times (is our
# AVX-512 kernel's one-thread speed what it was before the one-source change?), then the GPU tests.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
for rep in 1 2 3; do OMP_NUM_THREADS=1 bash gpu-bundle/run.sh gemm-bench --reps 5 2>&1 | sed -n 3,6p | tee -a $OUT/gemm-t1.log; done
bash gpu-bundle/run.sh tests > $OUT/gpu-tests.log 2>&1; grep -E "PASSED|FAILED|SKIPPED" $OUT/gpu-tests.log
