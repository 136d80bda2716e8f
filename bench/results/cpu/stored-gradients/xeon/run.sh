#!/usr/bin/env bash
# The GPU machine's Xeon, the AVX2 bundle (scripts/gpu_bundle.sh) after fake quantization's faster
# backward and the bias in the GEMM's store: ours against PyTorch 2.11 at 16 threads (two repetitions,
# interleaved), per-op profiles of the FP32 and QAT steps, and 1 and 4 threads for scaling.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
for rep in 1 2; do
  OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 32,128 --modes fp32,qat \
    --steps 5 --warmup 2 > $OUT/ours-t16-rep$rep.log 2>&1; cat $OUT/ours-t16-rep$rep.log
  python3 bench/torch_step_bench.py --presets tiny,mini --batches 32,128 --steps 5 --warmup 2 --threads 16 \
    --flush-denormals 2>&1 | sed "s/^/rep$rep /" >> $OUT/torch-t16.txt; grep rep$rep $OUT/torch-t16.txt
done
OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets mini --batches 128 --modes fp32,qat --steps 3 \
  --warmup 1 --profile > $OUT/profile-mini-t16.log 2>&1; grep -E "^mini|fake_quantize|^linear|^total" $OUT/profile-mini-t16.log
OMP_NUM_THREADS=1 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 --steps 3 \
  --warmup 1 > $OUT/ours-t1.log 2>&1; cat $OUT/ours-t1.log
OMP_NUM_THREADS=4 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 --steps 3 \
  --warmup 1 > $OUT/ours-t4.log 2>&1; cat $OUT/ours-t4.log
