#!/usr/bin/env bash
# The GPU machine's Xeon, the AVX2 bundle (scripts/gpu_bundle.sh) after the SGEMM's register-transposed
# B panels and copied A strips and the GELU in the GEMM's finish (ops::linear_gelu): gemm-bench at 16 and
# 1 threads, ours against PyTorch 2.11 at 16 threads (two repetitions, interleaved), the per-op profile
# of mini batch 128 at 16 threads. Run from the repository root with $OUT set (one device call).
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
OMP_NUM_THREADS=16 bash gpu-bundle/run.sh gemm-bench --reps 7 > $OUT/gemm-t16.log 2>&1; head -16 $OUT/gemm-t16.log
OMP_NUM_THREADS=1 bash gpu-bundle/run.sh gemm-bench --reps 3 > $OUT/gemm-t1.log 2>&1; head -16 $OUT/gemm-t1.log
for rep in 1 2; do
  OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 32,128 --modes fp32,qat \
    --steps 5 --warmup 2 > $OUT/ours-t16-rep$rep.log 2>&1; tail -9 $OUT/ours-t16-rep$rep.log
  python3 bench/torch_step_bench.py --presets tiny,mini --batches 32,128 --steps 5 --warmup 2 --threads 16 \
    --flush-denormals 2>&1 | sed "s/^/rep$rep /" >> $OUT/torch-t16.txt; grep rep$rep $OUT/torch-t16.txt | cut -c1-200
done
OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets mini --batches 128 --modes fp32 --steps 3 \
  --warmup 1 --profile > $OUT/profile-mini-t16.log 2>&1; grep -A16 "its evaluation" $OUT/profile-mini-t16.log
