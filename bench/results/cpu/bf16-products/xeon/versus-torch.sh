#!/usr/bin/env bash
# The GPU machine's Xeon, the AVX2 bundle with AMX BF16 products: ours with --precision bf16 against PyTorch
# 2.11 with BF16 autocast (oneDNN, AMX) in one call, 16 threads, tiny and mini at batch 32 and 128.
# Run from the repository root with $OUT set.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 32,128 --modes fp32 \
  --steps 5 --warmup 2 --precision bf16 > $OUT/ours-bf16-t16.log 2>&1
tail -5 $OUT/ours-bf16-t16.log
python3 bench/torch_step_bench.py --presets tiny,mini --batches 32,128 --steps 5 --warmup 2 --threads 16 \
  --flush-denormals --dtype bf16 > $OUT/torch-bf16-t16.txt 2>&1
cut -c1-200 $OUT/torch-bf16-t16.txt
