#!/usr/bin/env bash
# The FP32 GEMM's run-time kernel choice on the GPU machine's Xeon: the bundle is built for x86-64-v3
# (AVX2); 'build' runs Eigen for AVX2, 'avx512' the kernel compiled for AVX-512. PyTorch 2.11 beside.
tar -xJf gpu-bundle.tar.xz; export LD_LIBRARY_PATH=$PWD/gpu-bundle/lib
B=gpu-bundle/bin
lscpu | grep -E "^Model name|^CPU\(s\)"; grep -o -E "avx512[a-z_0-9]*|amx[a-z_0-9]*" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
uptime
OMP_NUM_THREADS=16 $B/gemm-bench --reps 5 2>&1 | sed -n 1,12p
for rep in 1 2; do
  for k in build avx512; do
    echo "== rep $rep threads 16 kernel $k"
    BERT_GEMM_KERNEL=$k OMP_NUM_THREADS=16 $B/train-step-bench --presets tiny,mini --batches 32,128 --modes fp32 \
      --steps 5 --warmup 2 2>&1 | grep -E "^(tiny|mini) |GEMM kernel"
  done
done
echo "== torch 16"
python3 bench/torch_step_bench.py --threads 16 --flush-denormals --presets tiny,mini --batches 32,128 --steps 5 \
  --warmup 2 | cut -c1-200
uptime
