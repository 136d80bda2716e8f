#!/usr/bin/env bash
# Training-step speed on a GPU, ours beside PyTorch on the same GPU in one run: BERT-base (seq 128,
# batch 64) and BERT-mini (batch 256), vocabulary 30522, FP32, TF32 and BF16 mixed precision, FP32 and
# QAT steps.
# Run on the GPU machine from the repository root with a bundle made by scripts/gpu_bundle.sh:
#   bash bench/gpu_speed.sh [ours|torch|all] > gpu_speed.txt
# PyTorch (bench/torch_step_bench.py) runs the same model in eager mode, and with torch.compile for BF16.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
steps=${BENCH_STEPS:-10}
if [ "$what" != torch ]; then
  for precision in fp32 tf32 bf16; do
    for config in "base 64" "mini 256"; do
      set -- $config
      bash gpu-bundle/run.sh train-step-bench --device cuda --precision "$precision" --presets "$1" --batches "$2" \
        --vocab 30522 --steps "$steps" --warmup 3 --modes "${MODES:-fp32,qat,qat-separate}" | grep -E "^(device|$1) " | sed "s/^/ours $precision: /"
    done
  done
fi
if [ "$what" != ours ]; then
  for dtype in fp32 tf32 bf16; do
    for config in "base 64" "mini 256"; do
      set -- $config
      python3 bench/torch_step_bench.py --device cuda --dtype "$dtype" --presets "$1" --batches "$2" --vocab 30522 \
        --steps "$steps" --warmup 3
    done
  done
  python3 bench/torch_step_bench.py --device cuda --dtype bf16 --compile --presets base --batches 64 --vocab 30522 \
    --steps "$steps" --warmup 3
fi
