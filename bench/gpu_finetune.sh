#!/usr/bin/env bash
# Fine-tuning with QAT on real tasks, on a GPU: BERT-mini pretrained on the demo data (bench/gpu_pretrain.sh,
# STEPS steps), then fine-tuned on Brown part-of-speech tagging (token classification, 12 tags), Brown
# genre classification (sequence classification, 15 genres) and Brown cloze questions (extractive question
# answering: a sentence's proper name to find in the rest of its passage, scored per question as SQuAD
# scores it; scripts/brown_tasks.py, split by document):
# FP32 fine-tuning, FP32 vs PTQ (each calibrator) on the test split, QAT, QAT + distillation from the FP32
# model, FP32 continued as long as QAT (the fair baseline), and the Q/DQ export of each QAT model scored in
# ONNX Runtime. Prepare here, run there from the repository root:
#   PACK=1 bash scripts/gpu_bundle.sh                          # here: gpu-bundle.tar.xz
#   tar -C cache -cJf cache-gpu/corpus.tar.xz corpus/{brown.txt,heldout.paragraphs.txt,train.paragraphs.txt,manifest.json}
#   python3 scripts/brown_tasks.py && tar -C cache -cJf cache-gpu/tasks.tar.xz tasks
#   bash bench/gpu_finetune.sh [RESULTS_DIR]                   # there (carry gpu-bundle.tar.xz and cache-gpu)
# Environment: STEPS (pretraining, default 6000), EPOCHS (fine-tuning, 3), QAT_EPOCHS (1), LR (1e-4),
# QAT_LR (2e-5), ORT_BATCHES (batches of 64 scored in ONNX Runtime, 40), TASKS ("pos genre qa"), CALIBRATORS
# (the PTQ calibrators compared, max,percentile,entropy,mse), PRESET and
# PRECISION (mini, tf32: passed on to gpu_pretrain.sh with PRETRAIN_LR as its LR; e.g. PRESET=base
# PRECISION=bf16 for BERT-base in BF16 mixed precision), VARIANTS (what follows the FP32 fine-tuning:
# "qat qat-distill fp32-more"; VARIANTS= for the FP32 model and its PTQ comparison only).
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-runs/gpu-finetune}
mkdir -p "$results" cache
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
[ -d cache/tasks ] || tar -C cache -xJf cache-gpu/tasks.tar.xz
run() { bash gpu-bundle/run.sh "$@"; }
ort_script=scripts/ort_run.js
command -v node > /dev/null || ort_script=scripts/ort_run.py  # Python's onnxruntime where Node is missing

precision=${PRECISION:-tf32}
preset=${PRESET:-mini}
pretrained=runs/mini-gpu
[ "$preset-$precision" = mini-tf32 ] || pretrained=runs/$preset-gpu-$precision
[ -f $pretrained/checkpoint.h5 ] ||
  STEPS=${STEPS:-6000} LR=${PRETRAIN_LR:-1e-3} VARIANTS= bash bench/gpu_pretrain.sh "$results/pretrain"
D=cache/data
epochs=${EPOCHS:-3}
qat_epochs=${QAT_EPOCHS:-1}
for task in ${TASKS:-pos genre qa}; do
  src=cache/tasks/brown-$task
  shards=cache/tasks/shards-$task
  case $task in
    genre) task_data=(--task seq-cls --labels "$src/labels.txt" --max-seq-len 128) ;;
    qa) task_data=(--task qa --max-seq-len 256 --doc-stride 128) ;;
    *) task_data=(--task token-cls --labels "$src/labels.txt" --max-seq-len 128) ;;
  esac
  answers=()  # question answering: each test question scored as SQuAD scores it
  [ "$task" = qa ] && answers=(--qa-data "$src/test.jsonl")
  mkdir -p "$shards"
  for split in train dev test; do
    [ -f "$shards/$split.hdf5" ] || run bert-data task "${task_data[@]}" --input "$src/$split.jsonl" \
      --tokenizer $D/spm.model --output "$shards/$split.hdf5" 2>&1 | tee -a "$results/$task-data.log"
  done
  examples=$(wc -l < "$src/train.jsonl")
  steps=$(( examples * epochs / 32 ))
  qat_steps=$(( examples * qat_epochs / 32 ))
  common=(--device cuda --precision $precision --train "$shards/train.hdf5" --eval "$shards/dev.hdf5" --batch-size 32
          --warmup 0.1 --eval-every 0 --log-every 200)
  r=runs/$task
  [ "$preset-$precision" = mini-tf32 ] || r=runs/$task-$preset-$precision
  run bert-train "${common[@]}" --init-from $pretrained --out $r-fp32 --steps $steps --lr ${LR:-1e-4} \
    2>&1 | tee "$results/$task-fp32.log" | grep -E "eval|done"
  run bert-eval --device cuda --checkpoint $r-fp32 --shards "$shards/test.hdf5" --compare \
    --calibrators ${CALIBRATORS:-max,percentile,entropy,mse} --calib-shards "$shards/train.hdf5" --calib-batches 16 \
    "${answers[@]}" --json-out "$results/$task-compare-fp32.json" \
    | tee "$results/$task-compare-fp32.txt"
  [ "$task" = qa ] && run bert-eval --device cuda --checkpoint $r-fp32 --shards "$shards/test.hdf5" "${answers[@]}" \
    --json-out "$results/$task-test-fp32.json" > "$results/$task-test-fp32.txt"
  # QAT (percentile calibration, learned scales), QAT + distillation, and FP32 trained as long again.
  for variant in ${VARIANTS-qat qat-distill fp32-more}; do
    extra=()
    case $variant in
      qat) extra=(--qat --calibrator percentile --calib-batches 16) ;;
      qat-distill) extra=(--qat --calibrator percentile --calib-batches 16 --distill 0.5 --distill-temperature 2) ;;
    esac
    run bert-train "${common[@]}" --init-from $r-fp32 --out $r-$variant --steps $qat_steps --lr ${QAT_LR:-2e-5} \
      "${extra[@]}" 2>&1 | tee "$results/$task-$variant.log" | grep -E "eval|done|saturated"
    run bert-eval --device cuda --checkpoint $r-$variant --shards "$shards/test.hdf5" "${answers[@]}" \
      --json-out "$results/$task-test-$variant.json" > "$results/$task-test-$variant.txt"
    head -4 "$results/$task-test-$variant.txt"
  done
  # The Q/DQ exports in ONNX Runtime (CPU), beside the engine on the same first ORT_BATCHES batches.
  for variant in ${VARIANTS-qat qat-distill}; do
    [[ $variant == qat* ]] || continue
    run bert-export --checkpoint $r-$variant --onnx $r-$variant/model.onnx --qdq 2>&1 | tail -1
    run bert-eval --device cuda --checkpoint $r-$variant --shards "$shards/test.hdf5" --batch-size 64 \
      --max-batches ${ORT_BATCHES:-40} --onnx $r-$variant/model.onnx --ort-script $ort_script "${answers[@]}" \
      --json-out "$results/$task-onnx-$variant.json" | grep -E "^accuracy|^exact match|ONNX Runtime" \
      | tee "$results/$task-onnx-$variant.txt"
  done
done
tar -C "$(dirname "$results")" -czf "$results.tar.gz" "$(basename "$results")"  # one file to fetch
