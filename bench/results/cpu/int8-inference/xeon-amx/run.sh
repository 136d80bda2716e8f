#!/usr/bin/env bash
# The Xeon's AMX tile unit for the integer GEMMs: the kernel tests (each kernel this CPU runs against the
# plain reference), gemm-bench's INT8 table at one thread, then INT8 evaluation against FP32 (tiny, mini
# batch 64; base batch 32 with BERT's vocabulary) at 16 threads and at 1, and the model's integer
# inference tests. Repository root, $OUT set.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
R="bash gpu-bundle/run.sh"
$R core_tests --gtest_brief=1 --gtest_filter='*Int8*:*RowArgmax*:*VectorMath*' > $OUT/kernel-tests.log 2>&1
tail -3 $OUT/kernel-tests.log
$R model_tests --gtest_brief=1 --gtest_filter='*nteger*:*Int8*' > $OUT/model-tests.log 2>&1; tail -3 $OUT/model-tests.log
OMP_NUM_THREADS=1 $R gemm-bench --reps 3 > $OUT/gemm-t1.log 2>&1; grep -A12 "^INT8" $OUT/gemm-t1.log
for t in 16 1; do
  OMP_NUM_THREADS=$t $R train-step-bench --presets tiny,mini --batches 64 --modes fp32,int8,int8-decoder \
    --steps 5 --warmup 2 > $OUT/int8-t$t.log 2>&1; grep -E "^(tiny|mini) " $OUT/int8-t$t.log
done
OMP_NUM_THREADS=16 $R train-step-bench --presets base --batches 32 --vocab 30522 --modes fp32,int8,int8-decoder \
  --steps 3 --warmup 1 > $OUT/int8-base-t16.log 2>&1; grep -E "^base " $OUT/int8-base-t16.log
OMP_NUM_THREADS=16 $R train-step-bench --presets tiny --batches 64 --modes int8-decoder --steps 5 --warmup 2 \
  --profile > $OUT/profile-tiny-int8-t16.log 2>&1; grep -A14 "int8-decoder evaluation" $OUT/profile-tiny-int8-t16.log
