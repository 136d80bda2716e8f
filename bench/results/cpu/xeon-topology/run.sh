#!/usr/bin/env bash
# The GPU machine's CPU topology and how a GEMM scales on it: lscpu and thread siblings, PyTorch 2.11's
# SGEMM (MKL/oneDNN) and ours (gemm-bench, the AVX2 bundle) at 1, 8 and 16 threads, our training step at 8.
# One device call, from the repository root with $OUT set, after `PACK=1 bash scripts/gpu_bundle.sh` here.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
lscpu > $OUT/lscpu.txt; grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|MHz|L1d|L2|L3' $OUT/lscpu.txt
for c in 0 1 8; do echo "cpu$c siblings: $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list)"; done
python3 - <<'PY' | tee $OUT/torch-sgemm.txt
import time, torch
for shape in [(2048, 2048, 2048), (4096, 1024, 256)]:
    m, n, k = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    for t in (1, 8, 16):
        torch.set_num_threads(t)
        for _ in range(3): a @ b
        best = min((lambda s: (a @ b, time.perf_counter() - s)[1])(time.perf_counter()) for _ in range(9))
        print(f"torch {torch.__version__} {m}x{n}x{k} threads {t}: {2 * m * n * k / best / 1e9:.1f} GFLOP/s")
PY
for t in 1 8 16; do
  echo "ours, $t threads:"; OMP_NUM_THREADS=$t bash gpu-bundle/run.sh gemm-bench --reps 5 2>&1 | sed -n '2,5p' | tee -a $OUT/gemm.txt
done
OMP_NUM_THREADS=8 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 --steps 3 \
  --warmup 1 2>&1 | tail -3 | tee $OUT/ours-t8.log
