#!/usr/bin/env bash
# Does distillation help QAT on a fine-tuned model, beyond the noise of the seed? From the FP32
# fine-tuned model of bench/gpu_finetune.sh (made first when missing), QAT with several seeds and QAT +
# distillation (--distill W --distill-temperature T) over a grid, each scored on the test split. The
# teacher is that FP32 model, or with TEACHER_PRESET (e.g. base) a larger model pretrained and fine-tuned
# on the task the same way (gpu_finetune.sh with that preset; made first when missing).
# Run on a machine with an NVIDIA GPU, from the repository root (carry gpu-bundle.tar.xz and cache-gpu, as for
# bench/gpu_finetune.sh):
#   bash bench/gpu_distill.sh [RESULTS_DIR]
# Environment: TASK (pos; or genre), PRESET (mini), PRECISION (bf16), SEEDS ("1 2 3"), GRID ("0.5:2 0.9:2
# 0.5:4 0.9:4", weight:temperature pairs), QAT_EPOCHS (1), QAT_LR (2e-5), and what gpu_finetune.sh takes
# to make the FP32 model (STEPS, EPOCHS, LR, PRETRAIN_LR); for a larger teacher TEACHER_PRESET,
# TEACHER_STEPS (3000), TEACHER_PRETRAIN_LR (2e-4), TEACHER_EPOCHS (3).
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-runs/gpu-distill}
mkdir -p "$results"
task=${TASK:-pos}
preset=${PRESET:-mini}
precision=${PRECISION:-bf16}
export PRESET=$preset PRECISION=$precision
r=runs/$task
[ "$preset-$precision" = mini-tf32 ] || r=runs/$task-$preset-$precision
[ -f $r-fp32/checkpoint.h5 ] || TASKS=$task CALIBRATORS=max VARIANTS= bash bench/gpu_finetune.sh "$results/finetune"
teacher=$r-fp32
if [ -n "${TEACHER_PRESET:-}" ]; then
  teacher=runs/$task-$TEACHER_PRESET-$precision-fp32
  [ -f $teacher/checkpoint.h5 ] ||
    PRESET=$TEACHER_PRESET STEPS=${TEACHER_STEPS:-3000} PRETRAIN_LR=${TEACHER_PRETRAIN_LR:-2e-4} \
      EPOCHS=${TEACHER_EPOCHS:-3} TASKS=$task CALIBRATORS=max VARIANTS= bash bench/gpu_finetune.sh "$results/teacher"
fi
run() { bash gpu-bundle/run.sh "$@"; }
shards=cache/tasks/shards-$task
examples=$(wc -l < cache/tasks/brown-$task/train.jsonl)
qat_steps=$(( examples * ${QAT_EPOCHS:-1} / 32 ))
common=(--device cuda --precision $precision --train "$shards/train.hdf5" --batch-size 32 --warmup 0.1
        --eval-every 0 --log-every 1000 --init-from $r-fp32 --steps $qat_steps --lr ${QAT_LR:-2e-5}
        --qat --calibrator percentile --calib-batches 16)
score() {  # name [model]: the test accuracy and macro-F1 of runs/distill-NAME (or model), one line
  run bert-eval --device cuda --checkpoint ${2:-runs/distill-$1} --shards "$shards/test.hdf5" \
    --json-out "$results/$1.json" > "$results/$1.txt"
  printf '%-24s %s\n' "$1" "$(grep -E '^(accuracy|macro-F1)' "$results/$1.txt" | awk '{printf "%s %s  ", $1, $2}')"
}
{ score student-fp32 $r-fp32; [ $teacher = $r-fp32 ] || score teacher $teacher; } | tee "$results/summary.txt"
for seed in ${SEEDS:-1 2 3}; do
  run bert-train "${common[@]}" --seed $seed --out runs/distill-qat-seed$seed > "$results/qat-seed$seed.log" 2>&1
  score qat-seed$seed
done | tee -a "$results/summary.txt"
for pair in ${GRID:-0.5:2 0.9:2 0.5:4 0.9:4}; do
  w=${pair%%:*} t=${pair##*:}
  for seed in ${SEEDS:-1 2 3}; do
    run bert-train "${common[@]}" --seed $seed --distill $w --distill-temperature $t --teacher $teacher \
      --out runs/distill-w$w-t$t-seed$seed > "$results/w$w-t$t-seed$seed.log" 2>&1
    score w$w-t$t-seed$seed
  done
done | tee -a "$results/summary.txt"
tar -C "$(dirname "$results")" -czf "$results.tar.gz" "$(basename "$results")"  # one file to fetch
