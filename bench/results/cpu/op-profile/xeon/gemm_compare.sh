#!/usr/bin/env bash
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
grep -o -w -E "avx512f|avx512_vnni|avx512_bf16|amx_tile|amx_bf16" /proc/cpuinfo | sort | uniq -c
grep -m1 MHz /proc/cpuinfo
python3 bench/results/cpu/op-profile/xeon/torch_gemm.py
for t in 1 16; do OMP_NUM_THREADS=$t bash gpu-bundle/run.sh gemm-bench --reps 5 2>&1 | sed -n 1,12p; done
