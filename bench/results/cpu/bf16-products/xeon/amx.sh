#!/usr/bin/env bash
# The GPU machine's Xeon after BF16 products moved to AMX's tile unit where the CPU has it (the AVX2 bundle,
# scripts/gpu_bundle.sh): the BF16 GEMM, op, golden-model and training tests (each holding AMX to its
# reference there); gemm-bench's BF16 table at 16 threads; train-step-bench FP32 and BF16 at 16 threads
# (tiny and mini, batch 32 and 128), interleaved. Run from the repository root with $OUT set (one call).
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
r=gpu-bundle/run.sh
bash $r core_tests --gtest_brief=1 --gtest_filter='*Gemm*:Bf16*' > $OUT/amx-tests.log 2>&1; echo "core $?"
bash $r model_tests --gtest_brief=1 --gtest_filter='BertGolden.*' >> $OUT/amx-tests.log 2>&1; echo "model $?"
bash $r train_tests --gtest_brief=1 --gtest_filter='*CpuBf16*' >> $OUT/amx-tests.log 2>&1; echo "train $?"
grep -E "PASSED|FAILED|Failure" $OUT/amx-tests.log | head -20
OMP_NUM_THREADS=16 bash $r gemm-bench --reps 5 > $OUT/gemm-t16.log 2>&1
sed -n '/BF16 operands/,/^$/p' $OUT/gemm-t16.log
for precision in fp32 bf16; do
  OMP_NUM_THREADS=16 bash $r train-step-bench --presets tiny,mini --batches 32,128 --modes fp32,qat \
    --steps 5 --warmup 2 --precision $precision > $OUT/ours-$precision-t16.log 2>&1
  tail -9 $OUT/ours-$precision-t16.log | sed "s/^/$precision /"
done
