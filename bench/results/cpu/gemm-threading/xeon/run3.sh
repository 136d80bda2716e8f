#!/usr/bin/env bash
tar -xJf gpu-bundle.tar.xz; export LD_LIBRARY_PATH=$PWD/gpu-bundle/lib
E=cache-gpu/exp
uptime
for rep in 1 2; do
  for cfg in eigen 2:64 4:64; do
    echo "== rep $rep threads 16 gemm $cfg"
    if [ $cfg = eigen ]; then X="BERT_GEMM_EIGEN_THREADS=1"; else X="BERT_GEMM_BLOCKS=${cfg%%:*} BERT_GEMM_MIN=${cfg##*:}"; fi
    env $X OMP_NUM_THREADS=16 $E/train-step-bench --presets tiny,mini --batches 32,128 --modes fp32 --steps 5 --warmup 2 2>&1 | grep -E "^(tiny|mini) "
  done
done
uptime
echo "== torch 16"
python3 bench/torch_step_bench.py --threads 16 --flush-denormals --presets tiny,mini --batches 32,128 --steps 5 --warmup 2 | cut -c1-200
