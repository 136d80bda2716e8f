#!/usr/bin/env bash
# Per-op profile on the Xeon, FP32 b128 tiny and mini, at 1, 4 and 16 threads (ours), and PyTorch's
# profile at 16 threads, into $OUT.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
lscpu | grep -E "Model name|Thread|Core|Socket|Flags" | cut -c1-300 > $OUT/lscpu.txt
for t in 1 4 16; do
  OMP_NUM_THREADS=$t bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 \
    --steps 3 --warmup 1 --profile-shapes > $OUT/ours-t$t.log 2>&1
  grep -E "^(tiny|mini) " $OUT/ours-t$t.log
done
for t in 16 4; do
  python3 bench/torch_step_bench.py --presets tiny,mini --batches 128 --steps 3 --warmup 1 --threads $t \
    --flush-denormals --profile > $OUT/torch-t$t.json 2> $OUT/torch-t$t.log
  cat $OUT/torch-t$t.json
done
