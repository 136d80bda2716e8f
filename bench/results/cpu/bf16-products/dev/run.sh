#!/usr/bin/env bash
# The development machine (AMD EPYC, 2 cores, AVX512_BF16): gemm-bench's BF16 table on 1 and 2 threads, then
# train-step-bench FP32 against BF16 products (tiny and mini, batch 32 and 128, FP32 and QAT steps, 2 threads),
# two interleaved repetitions. From the repository root after `bash scripts/build.sh`:
#   bash bench/results/cpu/bf16-products/dev/run.sh bench/results/cpu/bf16-products/dev
set -euo pipefail
out=${1:?output folder}
mkdir -p "$out"
for threads in 1 2; do
  OMP_NUM_THREADS=$threads build/bench/gemm-bench --reps 5 > "$out/gemm-t$threads.log" 2>&1
  sed -n '/BF16 operands/,/^$/p' "$out/gemm-t$threads.log"
done
for rep in 1 2; do
  for precision in fp32 bf16; do
    OMP_NUM_THREADS=2 build/bench/train-step-bench --presets tiny,mini --batches 32,128 --modes fp32,qat --steps 5 \
      --warmup 2 --precision $precision > "$out/ours-$precision-t2-rep$rep.log" 2>&1
    tail -8 "$out/ours-$precision-t2-rep$rep.log" | sed "s/^/rep$rep $precision /"
  done
done
