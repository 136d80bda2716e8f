#!/usr/bin/env bash
# The GPU machine's Xeon, the AVX2 bundle (scripts/gpu_bundle.sh): INT8 evaluation with Q, K and V as one
# integer linear (int8) against three (int8-separate), FP32 beside them, 16 threads, batch 32 and 128, two
# repetitions; first the integer and BF16 GEMM tests (both AMX kernels there). Run from the repository root
# with $OUT set (one call).
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
bash gpu-bundle/run.sh core_tests --gtest_brief=1 --gtest_filter='*Int8*:*Gemm*:Bf16*' > $OUT/amx-tests.log 2>&1
echo "core_tests $?"; grep -E "PASSED|FAILED" $OUT/amx-tests.log
for rep in 1 2; do
  OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 32,128 \
    --modes fp32,int8,int8-separate --steps 7 --warmup 2 > $OUT/int8-t16-rep$rep.log 2>&1
  grep -E "^(tiny|mini)" $OUT/int8-t16-rep$rep.log | sed "s/^/rep$rep /"
done
