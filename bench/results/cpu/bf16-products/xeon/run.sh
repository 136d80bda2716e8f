#!/usr/bin/env bash
# The GPU machine's Xeon, the AVX2 bundle (scripts/gpu_bundle.sh): BF16 products (vdpbf16ps, chosen at run
# time) against FP32 in one call: gemm-bench's BF16 table at 16 threads; train-step-bench FP32 and BF16
# (tiny and mini, batch 32 and 128, 16 threads, two interleaved repetitions); PyTorch 2.11 in FP32 and with
# BF16 autocast (oneDNN) at 16 threads beside them. Its results, in vdpbf16ps/, are of a bundle whose BF16
# products ran on vdpbf16ps there (amx.sh measures them on AMX). Every GPU test in a second call (tests.sh).
# Run from the repository root with $OUT set.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
grep -o -w -E "avx512_bf16|amx_bf16|avx512_vnni" /proc/cpuinfo | sort | uniq -c > $OUT/cpu-flags.txt; cat $OUT/cpu-flags.txt
OMP_NUM_THREADS=16 bash gpu-bundle/run.sh gemm-bench --reps 5 > $OUT/gemm-t16.log 2>&1
sed -n '/BF16 operands/,/^$/p' $OUT/gemm-t16.log
for rep in 1 2; do
  for precision in fp32 bf16; do
    OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 32,128 --modes fp32,qat \
      --steps 5 --warmup 2 --precision $precision > $OUT/ours-$precision-t16-rep$rep.log 2>&1
    tail -9 $OUT/ours-$precision-t16-rep$rep.log | sed "s/^/rep$rep $precision /"
  done
  for dtype in fp32 bf16; do
    python3 bench/torch_step_bench.py --presets tiny,mini --batches 32,128 --steps 5 --warmup 2 --threads 16 \
      --flush-denormals --dtype $dtype 2>&1 | sed "s/^/rep$rep /" >> $OUT/torch-$dtype-t16.txt
    grep rep$rep $OUT/torch-$dtype-t16.txt | cut -c1-220
  done
done
