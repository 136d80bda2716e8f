#!/usr/bin/env bash
# INT8 inference on the CPU, per model size: `bert-eval --int8` (FP32, the fake-quantized model and
# integer GEMMs, each timed, with the share of INT8 predictions equal to the fake-quantized model's),
# and the same Q/DQ model exported to ONNX and run by ONNX Runtime (its integer kernels) and the FP32
# export, timed inside session.run (BERT_ORT_TIMING); then `--int8 --int8-decoder` (the MLM decoder as
# integers too, dynamically quantized: not what the export runs).
# Each model: FP32 pretraining for STEPS steps on the demo data (scripts/demo_data.sh, built on first
# use), then post-training quantization (percentile calibration on 16 training batches, saved by
# bert-eval --save-calibrated), then the evaluations on BATCHES held-out batches of 64 sequences.
# Usage: bash bench/int8_eval.sh RESULTS_DIR
# Environment: PRESETS ("tiny mini"), STEPS (300), BATCHES (20), THREADS (all cores), B (./build/tools)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bench/int8_eval.sh RESULTS_DIR}
PRESETS=${PRESETS:-"tiny mini"}
STEPS=${STEPS:-300}
BATCHES=${BATCHES:-20}
B=${B:-./build/tools}
THREADS_FLAG=()
[ -n "${THREADS:-}" ] && THREADS_FLAG=(--threads "$THREADS")
mkdir -p "$OUT"
bash scripts/demo_data.sh > "$OUT/data.log" 2>&1
D=cache/data
for preset in $PRESETS; do
  R=$OUT/$preset
  if [ ! -f "$R/fp32/checkpoint.h5" ]; then
    $B/bert-train --train $D/shards/train --tokenizer $D/spm.model --out "$R/fp32" --preset "$preset" \
      --steps "$STEPS" --batch-size 64 --lr 1e-3 --warmup 0.1 --log-every $(( STEPS / 5 > 0 ? STEPS / 5 : 1 )) \
      --save-every 0 "${THREADS_FLAG[@]}" > "$R.train.log" 2>&1 || { tail "$R.train.log"; exit 1; }
  fi
  mkdir -p "$R/ptq"
  $B/bert-eval --checkpoint "$R/fp32" --shards $D/shards/heldout --max-batches 1 --save-calibrated "$R/ptq/checkpoint.h5" \
    --calibrator percentile --calib-shards $D/shards/train --calib-batches 16 "${THREADS_FLAG[@]}" > /dev/null 2> "$R.ptq.log"
  echo "== $preset: bert-eval --int8 ($BATCHES held-out batches of 64)" | tee "$R.int8.txt"
  $B/bert-eval --checkpoint "$R/ptq" --shards $D/shards/heldout --int8 --max-batches "$BATCHES" "${THREADS_FLAG[@]}" \
    --json-out "$R.int8.json" 2> "$R.int8.log" | tee -a "$R.int8.txt"
  echo "== $preset: bert-eval --int8 --int8-decoder (the MLM decoder as integers too)" | tee "$R.int8-decoder.txt"
  $B/bert-eval --checkpoint "$R/ptq" --shards $D/shards/heldout --int8 --int8-decoder --max-batches "$BATCHES" \
    "${THREADS_FLAG[@]}" --json-out "$R.int8-decoder.json" 2> "$R.int8-decoder.log" | tee -a "$R.int8-decoder.txt"
  $B/bert-export --checkpoint "$R/ptq" --onnx "$R/int8-qdq.onnx" --qdq --masked-positions > "$R.export.log" 2>&1
  $B/bert-export --checkpoint "$R/fp32" --onnx "$R/fp32.onnx" --masked-positions >> "$R.export.log" 2>&1
  for model in fp32 int8-qdq; do
    BERT_ORT_TIMING="$R/ort-$model.timing.json" $B/bert-eval --checkpoint "$R/ptq" --shards $D/shards/heldout \
      --max-batches "$BATCHES" --onnx "$R/$model.onnx" --mlm-accuracy "${THREADS_FLAG[@]}" > "$R/ort-$model.txt" 2>&1
  done
  python3 - "$R" <<'PY' | tee -a "$R.int8.txt"
import json, sys
r = sys.argv[1]
ours = {m["mode"]: m for m in json.load(open(r + ".int8.json"))["int8"]["modes"]}
fp32 = ours["fp32"]["sequences_per_second"]
for name in ["fp32", "int8-qdq"]:
    t = json.load(open(f"{r}/ort-{name}.timing.json"))
    sps = t["sequences"] / t["seconds"]
    print(f"ONNX Runtime {name:9s} {sps:10.1f} sequences/s (session.run only; {sps / fp32:.2f}x our FP32, "
          f"our INT8 {ours['int8']['sequences_per_second'] / sps:.2f}x this)")
PY
done
