#!/usr/bin/env bash
# The whole pipeline, raw text to a verified INT8 ONNX model: corpus -> tokenizer -> shards -> FP32
# pretraining -> PTQ comparison -> sensitivity -> QAT -> evaluation -> FP32 and Q/DQ ONNX export (+ the
# TensorRT calibration cache) -> ONNX Runtime verification -> report. Assumes a build (scripts/build.sh).
#
# Usage: bash scripts/pipeline.sh [--fixture] [--cpu] [--out DIR] [--steps N] [--qat-steps N]
#   default: the demo corpus (Debian docs + KJV, Brown held out). With an NVIDIA GPU (bert-train
#     --list-devices shows one): BERT-mini, 10,000 BF16 steps + 1,000 QAT steps on the GPU, past the MLM
#     plateau (a few minutes in all). Without one: the tiny preset, 600 + 100 steps (~15 min on 2 cores),
#     still in the plateau (the report says what that means).
#   --cpu: the CPU recipe even where a GPU is present
#   --fixture: the committed KJV fixture and a minuscule model, for CI (about a minute)
set -euo pipefail
cd "$(dirname "$0")/.."
FIXTURE=0 CPU=0 OUT="" STEPS="" QAT_STEPS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --fixture) FIXTURE=1 ;;
    --cpu) CPU=1 ;;
    --out) OUT=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --qat-steps) QAT_STEPS=$2; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "pipeline: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
B=${BERT_BIN:-./build/tools}
# The recipe: the fixture (CI), a GPU's (a model past the MLM plateau) or the CPU's.
if [ "$FIXTURE" = 1 ]; then
  RECIPE=fixture
elif [ "$CPU" = 0 ] && $B/bert-train --list-devices | grep -q '^cuda:'; then
  RECIPE=gpu GPU_NAME=$($B/bert-train --list-devices | grep -m1 '^cuda:')
else
  RECIPE=cpu
fi
case $RECIPE in
  fixture) : "${OUT:=runs/pipeline-fixture}" "${STEPS:=600}" "${QAT_STEPS:=60}"; TRAIN_DEVICE=(--device cpu) ;;
  gpu) : "${OUT:=runs/pipeline}" "${STEPS:=10000}" "${QAT_STEPS:=1000}"; TRAIN_DEVICE=(--device cuda --precision bf16) ;;
  cpu) : "${OUT:=runs/pipeline}" "${STEPS:=600}" "${QAT_STEPS:=100}"; TRAIN_DEVICE=(--device cpu) ;;
esac
START=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - START ))s] $*"; }
mkdir -p "$OUT"

if [ "$FIXTURE" = 1 ]; then
  step "data: fixture corpus -> tokenizer -> shards"
  D=$OUT/data
  mkdir -p "$D"
  $B/bert-data split --input tests/fixtures/kjv_paragraphs.txt --output "$D/corpus.txt"
  $B/bert-data tokenizer --input "$D/corpus.txt" --output "$D/spm" --vocab-size 800 2>/dev/null
  for part in train heldout; do
    rm -rf "$D/shards/$part"
    $B/bert-data shards --input "$D/corpus.txt" --tokenizer "$D/spm.model" --output "$D/shards/$part" --prefix "$part" \
      --max-seq-len 64 --max-predictions 10 --dupe-factor $([ $part = train ] && echo 3 || echo 1) \
      --seed $([ $part = train ] && echo 1 || echo 2)
  done
  TOKENIZER=$D/spm.model TRAIN=$D/shards/train HELDOUT=$D/shards/heldout OTHER=""
  cat > "$OUT/model.json" <<'JSON'
{"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64}
JSON
  MODEL=(--config "$OUT/model.json") BATCH=32 LR=5e-3 CALIB=4 EVAL_BATCHES=0 SENSITIVITY_BATCHES=0
else
  step "data: demo corpus -> tokenizer -> shards (cached after the first run)"
  OUT=cache BERT_DATA="$B/bert-data" bash scripts/demo_data.sh  # its OUT, not ours (ours may be exported)
  TOKENIZER=cache/data/spm.model TRAIN=cache/data/shards/train HELDOUT=cache/data/shards/heldout OTHER=cache/data/shards/brown
  MODEL=(--preset tiny) BATCH=128 LR=1e-3 CALIB=16 EVAL_BATCHES=40 SENSITIVITY_BATCHES=8
  if [ $RECIPE = gpu ]; then
    step "recipe: BERT-mini, $STEPS BF16 steps + $QAT_STEPS QAT steps on $GPU_NAME (--cpu: the CPU recipe)"
    MODEL=(--preset mini) EVAL_BATCHES=200 SENSITIVITY_BATCHES=20
  else
    step "recipe: BERT-tiny, $STEPS FP32 steps + $QAT_STEPS QAT steps on the CPU"
  fi
fi

step "pretraining: $STEPS steps"
rm -rf "$OUT/fp32"
$B/bert-train "${TRAIN_DEVICE[@]}" --train "$TRAIN" --eval "$HELDOUT" --tokenizer "$TOKENIZER" --out "$OUT/fp32" "${MODEL[@]}" \
  --steps "$STEPS" --batch-size $BATCH --lr $LR --warmup 0.1 --log-every $(( STEPS / 10 > 0 ? STEPS / 10 : 1 )) \
  --eval-every $(( STEPS / 2 )) --eval-batches 0 --save-every 0

step "sensitivity (percentile) and plan"
$B/bert-eval --checkpoint "$OUT/fp32" --shards "$HELDOUT" --sensitivity --calibrator percentile \
  --calib-shards "$TRAIN" --calib-batches $CALIB --max-batches $SENSITIVITY_BATCHES --max-drop 0.005 --plan-out "$OUT/plan.json" \
  --json-out "$OUT/sensitivity.json" 2>/dev/null | tail -3

step "QAT: $QAT_STEPS steps from the FP32 checkpoint"
rm -rf "$OUT/qat"
$B/bert-train "${TRAIN_DEVICE[@]}" --init-from "$OUT/fp32/checkpoint.h5" --qat --calibrator percentile --calib-batches $CALIB \
  --plan "$OUT/plan.json" --train "$TRAIN" --eval "$HELDOUT" --tokenizer "$TOKENIZER" --out "$OUT/qat" \
  --steps "$QAT_STEPS" --batch-size $BATCH --lr $(echo "$LR" | awk '{print $1 / 10}') --scale-lr-mult 10 \
  --log-every $(( QAT_STEPS / 4 > 0 ? QAT_STEPS / 4 : 1 )) --eval-every 0 --eval-batches 0 --save-every 0

step "export: FP32 and Q/DQ ONNX (checked), TensorRT calibration cache"
mkdir -p "$OUT/export"
$B/bert-export --checkpoint "$OUT/fp32" --onnx "$OUT/export/bert-fp32.onnx" --masked-positions \
  --trt-calib-cache "$OUT/export/bert-fp32.trt.cache" --calib-shards "$TRAIN" --calib-batches $CALIB
$B/bert-export --checkpoint "$OUT/qat" --onnx "$OUT/export/bert-int8-qdq.onnx" --qdq --masked-positions --plan "$OUT/plan.json" \
  --triton-repo "$OUT/triton" --triton-name bert_int8 --report-json "$OUT/export/fusion.json"
# The recipe this run used, for the report.
cat > "$OUT/recipe.json" <<JSON
{"model": "$( [ $RECIPE = fixture ] && echo fixture || echo "${MODEL[1]}")", "steps": $STEPS,
 "trained_on": "$( [ $RECIPE = gpu ] && echo "$GPU_NAME, BF16" || echo "the CPU, FP32")", "qat_steps": $QAT_STEPS, "calibrator": "percentile", "percentile": 99.99, "calib_batches": $CALIB,
 "scales": "learned", "lr": $(echo "$LR" | awk '{print $1 / 10}'), "scale_lr_mult": 10, "plan": "plan.json",
 "trt_cache_calibrator": "max"}
JSON

# The ONNX Runtime runs' result lines (and warnings) from bert-eval's output, read to the end: `head -1`
# closed the pipe early, and bert-eval's next line then ended it with SIGPIPE (a failure under pipefail)
# wherever a warning came first (a CPU without VNNI).
ort_lines() { grep -E '^ONNX Runtime|\[warning\]'; }
for set in heldout $([ -n "$OTHER" ] && echo brown); do
  shards=$([ $set = heldout ] && echo "$HELDOUT" || echo "$OTHER")
  step "evaluation on $set: FP32 vs PTQ (4 calibrators), QAT, and both exports in ONNX Runtime"
  $B/bert-eval --checkpoint "$OUT/fp32" --shards "$shards" --compare --calib-shards "$TRAIN" --calib-batches $CALIB \
    --max-batches $EVAL_BATCHES --json-out "$OUT/compare_$set.json"
  $B/bert-eval --checkpoint "$OUT/fp32" --shards "$shards" --max-batches $EVAL_BATCHES \
    --onnx "$OUT/export/bert-fp32.onnx" --json-out "$OUT/onnx_fp32_$set.json" | ort_lines
  $B/bert-eval --checkpoint "$OUT/qat" --shards "$shards" --max-batches $EVAL_BATCHES \
    --onnx "$OUT/export/bert-int8-qdq.onnx" --json-out "$OUT/onnx_int8_$set.json" | ort_lines
  $B/bert-eval --checkpoint "$OUT/qat" --shards "$shards" --max-batches $EVAL_BATCHES --int8 \
    --json-out "$OUT/int8_$set.json" | tail -4
done

step "report"
python3 scripts/plots.py "$OUT"
python3 scripts/report.py "$OUT"
echo "=== done in $(( $(date +%s) - START ))s: $OUT/report.md"
