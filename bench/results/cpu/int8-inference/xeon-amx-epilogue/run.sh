#!/usr/bin/env bash
# The Xeon after the INT8 epilogue loads a block's offsets, scales and bias once for all its rows (VNNI and
# AMX): the kernel tests, gemm-bench's INT8 table at one thread, INT8 evaluation against FP32 at 16
# threads (tiny, mini batch 64; base batch 32 with BERT's vocabulary), then FP32 training scaling in
# alternating rounds. Repository root, $OUT set.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
R="bash gpu-bundle/run.sh"
$R core_tests --gtest_brief=1 --gtest_filter='*Int8*' > $OUT/kernel-tests.log 2>&1; tail -1 $OUT/kernel-tests.log
OMP_NUM_THREADS=1 $R gemm-bench --reps 3 > $OUT/gemm-t1.log 2>&1; grep -A10 "^INT8" $OUT/gemm-t1.log
OMP_NUM_THREADS=16 $R train-step-bench --presets tiny,mini --batches 64 --modes fp32,int8,int8-decoder \
  --steps 5 --warmup 2 > $OUT/int8-t16.log 2>&1; grep -E "^(tiny|mini) " $OUT/int8-t16.log
OMP_NUM_THREADS=16 $R train-step-bench --presets base --batches 32 --vocab 30522 --modes fp32,int8,int8-decoder \
  --steps 3 --warmup 1 > $OUT/int8-base-t16.log 2>&1; grep -E "^base " $OUT/int8-base-t16.log
OMP_NUM_THREADS=16 $R train-step-bench --presets tiny,mini --batches 128,32 --modes fp32 --steps 3 --warmup 2 \
  --scaling-rounds 3 --json $OUT/rounds.json > $OUT/rounds.log 2>&1; grep -E "^(tiny|mini) |scaling" $OUT/rounds.log
