#!/usr/bin/env bash
# Training-step speed on a GPU, ours beside PyTorch on the same GPU in one run: BERT-base (seq 128,
# batch 64), BERT-mini (batch 256), BERT-large (batch 32) and BERT-base at length 512 (batch 16),
# vocabulary 30522, FP32, TF32 and BF16 mixed precision, FP32 and QAT steps; seq/s and peak GPU memory.
# Run on a machine with an NVIDIA GPU, from the repository root, with a bundle made by scripts/gpu_bundle.sh:
#   bash bench/gpu_speed.sh [ours|torch|compiled|all|qat] > gpu_speed.txt
# PyTorch (bench/torch_step_bench.py) runs the same model three ways: eager as written (explicit
# attention, AdamW's default), eager with fused attention (scaled_dot_product_attention) and fused AdamW,
# and that under torch.compile (`compiled`; a minute of compilation per configuration), in its default mode
# and in reduce-overhead mode (CUDA graphs: no per-kernel launch cost on the host). `qat`: ours (MODES) beside
# PyTorch's QAT step in every precision of PRECISIONS (torch_step_bench.py --qat: the quantizers of
# bert-train --qat, LSQ in tensor ops, the attention written out, fused AdamW) under torch.compile in each
# of COMPILE_MODES, then its float step at its best (SDPA, fused AdamW, compiled in BF16).
# Environment: BENCH_STEPS (10), CONFIGS (the "preset batch seq" triples below), PRECISIONS (fp32 tf32
# bf16), COMPILED_PRECISIONS (bf16: the compiled runs), COMPILE_MODES (default reduce-overhead), MODES (ours:
# fp32,fp32-fused,fp32-recompute,qat,qat-fused,qat-separate; fp32-fused is the step with fused attention,
# bert-train's default in BF16 and TF32, fp32 the unfused one, its default in FP32, fp32-recompute the unfused
# one with the scores and probabilities computed again in the backward, --attention recompute; qat-fused the
# QAT step with the fused attention, bert-train --qat's default in BF16; qat the QAT step with the unfused
# attention, the default in FP32 and TF32), WARMUP_SECONDS (2).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
steps=${BENCH_STEPS:-10}
# Both sides warm up for at least this long: a GPU reaches its full clocks only after a moment of load
# (BERT-mini's first half second of steps ran at 60-80% of its later speed on an H200).
warmup_seconds=${WARMUP_SECONDS:-2}
configs=${CONFIGS:-"base 64 128;mini 256 128;large 32 128;base 16 512"}
precisions=${PRECISIONS:-fp32 tf32 bf16}
each_config() {  # calls "$@" preset batch seq for every configuration
  local IFS=';'
  for config in $configs; do
    IFS=' ' read -r preset batch seq <<< "$config"
    "$@" "$preset" "$batch" "$seq"
  done
}
ours() {
  bash gpu-bundle/run.sh train-step-bench --device cuda --precision "$precision" --presets "$1" --batches "$2" \
    --seq "$3" --vocab 30522 --steps "$steps" --warmup 3 --warmup-seconds "$warmup_seconds" \
    --modes "${MODES:-fp32,fp32-fused,fp32-recompute,qat,qat-fused,qat-separate}" |
    grep -E "^(device|$1) " | sed "s/^/ours $precision seq $3: /"
}
torch_tiers() {
  python3 bench/torch_step_bench.py --device cuda --dtype "$precision" --presets "$1" --batches "$2" --seq "$3" \
    --vocab 30522 --steps "$steps" --warmup 3 --warmup-seconds "$warmup_seconds"
  python3 bench/torch_step_bench.py --device cuda --dtype "$precision" --presets "$1" --batches "$2" --seq "$3" \
    --vocab 30522 --steps "$steps" --warmup 3 --warmup-seconds "$warmup_seconds" --attention sdpa --adamw fused
}
torch_compiled() {
  local IFS=' ' mode  # each_config splits on ';'
  for mode in ${COMPILE_MODES:-default reduce-overhead}; do
    python3 bench/torch_step_bench.py --device cuda --dtype "$precision" --presets "$1" --batches "$2" --seq "$3" \
      --vocab 30522 --steps "$steps" --warmup 3 --warmup-seconds "$warmup_seconds" --attention sdpa --adamw fused \
      --compile --compile-mode "$mode"
  done
}
torch_qat() {
  local IFS=' ' mode
  for mode in ${COMPILE_MODES:-default reduce-overhead}; do
    python3 bench/torch_step_bench.py --device cuda --dtype "$precision" --presets "$1" --batches "$2" --seq "$3" \
      --vocab 30522 --steps "$steps" --warmup 3 --warmup-seconds "$warmup_seconds" --qat --adamw fused \
      --compile --compile-mode "$mode"
  done
  local best=(--attention sdpa --adamw fused)
  [ "$precision" = bf16 ] && best+=(--compile --compile-mode reduce-overhead)
  python3 bench/torch_step_bench.py --device cuda --dtype "$precision" --presets "$1" --batches "$2" --seq "$3" \
    --vocab 30522 --steps "$steps" --warmup 3 --warmup-seconds "$warmup_seconds" "${best[@]}"
}
if [ "$what" = qat ]; then
  for precision in $precisions; do
    each_config ours
    each_config torch_qat
  done
  exit 0
fi
for precision in $precisions; do
  [ "$what" = ours ] || [ "$what" = all ] && each_config ours
  [ "$what" = torch ] || [ "$what" = all ] && each_config torch_tiers
done
if [ "$what" = compiled ] || [ "$what" = all ]; then
  for precision in ${COMPILED_PRECISIONS:-bf16}; do each_config torch_compiled; done
fi
