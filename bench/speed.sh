#!/usr/bin/env bash
# Training speed, ours against PyTorch, in one run: train-step-bench (FP32 and QAT steps,
# evaluation, the SGEMM ceiling), then the same model and shapes in PyTorch 1.13 (Debian's
# python3-torch with OpenBLAS, both installed if missing) with two thread settings, its FP32 step and its QAT
# step (torch_step_bench.py --qat: the same quantizers), then the table of ratios (OUT/speed.md). About 10
# minutes on 2 cores; keep the machine otherwise idle.
# Usage: bash bench/speed.sh [OUT_DIR=runs/speed] [--presets tiny,mini] [--batches 32,128]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/speed}
shift || true
BUILD=${BUILD:-build}
# Without libopenblas0 Debian's PyTorch multiplies with the reference BLAS (about 6 GFLOP/s here, ten times
# slower steps): the baseline would be meaningless.
bash scripts/setup.sh python3-torch libopenblas0-pthread > /dev/null
[ -x "$BUILD/bench/train-step-bench" ] || bash scripts/build.sh
mkdir -p "$OUT"
PY=/usr/bin/python3  # Debian's interpreter, where python3-torch lives
{ echo "date: $(date -u +%FT%TZ)"; lscpu | grep -E '^Model name|^CPU\(s\)'
  echo "PyTorch's BLAS: $(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3)"; echo "commit: $(git rev-parse --short HEAD)"; } | tee "$OUT/machine.txt"
"$BUILD/bench/train-step-bench" --json "$OUT/ours.jsonl" "$@"
echo "PyTorch, torch.set_num_threads(1), OpenBLAS 2 threads:"
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=2 $PY bench/torch_step_bench.py --threads 1 "$@" | tee "$OUT/torch-1.jsonl"
echo "PyTorch, torch.set_num_threads(2), OpenBLAS 1 thread:"
OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=1 $PY bench/torch_step_bench.py --threads 2 "$@" | tee "$OUT/torch-2.jsonl"
echo "PyTorch's QAT step, the same two settings:"
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=2 $PY bench/torch_step_bench.py --threads 1 --qat "$@" | tee "$OUT/torch-1-qat.jsonl"
OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=1 $PY bench/torch_step_bench.py --threads 2 --qat "$@" | tee "$OUT/torch-2-qat.jsonl"
python3 bench/speed_table.py "$OUT"
