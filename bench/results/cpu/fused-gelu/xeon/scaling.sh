#!/usr/bin/env bash
# The same bundle on the Xeon: ours and PyTorch 2.11 at 1 and 4 threads (batch 128), for the scaling of
# each against its own one-thread speed, then the GPU tests (the CUDA ops and model against the CPU's).
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
for t in 1 4; do
  OMP_NUM_THREADS=$t bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 --steps 3 \
    --warmup 1 > $OUT/ours-t$t.log 2>&1; tail -3 $OUT/ours-t$t.log
  python3 bench/torch_step_bench.py --presets tiny,mini --batches 128 --steps 3 --warmup 1 --threads $t \
    --flush-denormals > $OUT/torch-t$t.txt 2>&1; cut -c1-200 $OUT/torch-t$t.txt
done
bash gpu-bundle/run.sh tests > $OUT/gpu-tests.log 2>&1; grep -E "PASSED|FAILED|SKIPPED|tests ran" $OUT/gpu-tests.log
