#!/usr/bin/env bash
# The Xeon after our SGEMM kernel became one source for AVX-512 and AVX2 (core/gemm_blocked.inc): gemm-bench
# at 16 and 1 threads (build = Eigen AVX2, avx2 and avx512 = ours), our training step at 16 threads (two
# repetitions), then the GPU tests. One device call from the repository root with $OUT set, after
# `PACK=1 bash scripts/gpu_bundle.sh` here.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
for t in 16 1; do OMP_NUM_THREADS=$t bash gpu-bundle/run.sh gemm-bench --reps 5 > $OUT/gemm-t$t.log 2>&1; head -16 $OUT/gemm-t$t.log; done
for rep in 1 2; do
  OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 32,128 --modes fp32 \
    --steps 5 --warmup 2 > $OUT/ours-t16-rep$rep.log 2>&1; tail -5 $OUT/ours-t16-rep$rep.log
done
bash gpu-bundle/run.sh tests > $OUT/gpu-tests.log 2>&1; grep -E "PASSED|FAILED|SKIPPED" $OUT/gpu-tests.log
