#!/usr/bin/env bash
# The packed AVX-512 SGEMM kernel on the Xeon: gemm-bench (Eigen vs ours) at 1 and 16 threads, the
# training step and evaluation against PyTorch 2.11 at 16 threads, a per-op profile, and 1 -> 16 scaling.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
for t in 1 16; do OMP_NUM_THREADS=$t bash gpu-bundle/run.sh gemm-bench --reps 5 2>&1 | sed -n 1,17p | tee $OUT/gemm-t$t.log; done
OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 32,128 --modes fp32,qat \
  --steps 5 --warmup 2 --json $OUT/ours-t16.json > $OUT/ours-t16.log 2>&1; cat $OUT/ours-t16.log
python3 bench/torch_step_bench.py --presets tiny,mini --batches 32,128 --steps 5 --warmup 2 --threads 16 \
  --flush-denormals > $OUT/torch-t16.json 2>&1; cat $OUT/torch-t16.json
OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets mini --batches 128 --modes fp32 --steps 3 \
  --warmup 1 --profile-shapes > $OUT/profile-mini-t16.log 2>&1
OMP_NUM_THREADS=1 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 --steps 3 \
  --warmup 1 > $OUT/ours-t1.log 2>&1; cat $OUT/ours-t1.log
