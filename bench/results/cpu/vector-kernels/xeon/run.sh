#!/usr/bin/env bash
# The GPU machine's Xeon, the bundle built for AVX2 (scripts/gpu_bundle.sh): the vector kernels of each
# CPU kernel set (gemm-bench, 1 and 16 threads), then ours against PyTorch 2.11 at 16 threads (two
# repetitions, interleaved), a per-op profile, and 1 and 4 threads for scaling.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
OMP_NUM_THREADS=1 bash gpu-bundle/run.sh gemm-bench --reps 5 > $OUT/gemm-t1.log 2>&1; tail -7 $OUT/gemm-t1.log
OMP_NUM_THREADS=16 bash gpu-bundle/run.sh gemm-bench --reps 5 > $OUT/gemm-t16.log 2>&1; tail -7 $OUT/gemm-t16.log
for rep in 1 2; do
  OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 32,128 --modes fp32,qat \
    --steps 5 --warmup 2 > $OUT/ours-t16-rep$rep.log 2>&1; cat $OUT/ours-t16-rep$rep.log
  python3 bench/torch_step_bench.py --presets tiny,mini --batches 32,128 --steps 5 --warmup 2 --threads 16 \
    --flush-denormals 2>&1 | sed "s/^/rep$rep /" >> $OUT/torch-t16.txt; grep rep$rep $OUT/torch-t16.txt
done
OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets mini --batches 128 --modes fp32 --steps 3 \
  --warmup 1 --profile-shapes > $OUT/profile-mini-t16.log 2>&1
OMP_NUM_THREADS=1 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 --steps 3 \
  --warmup 1 > $OUT/ours-t1.log 2>&1; cat $OUT/ours-t1.log
OMP_NUM_THREADS=4 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 --steps 3 \
  --warmup 1 > $OUT/ours-t4.log 2>&1; cat $OUT/ours-t4.log
