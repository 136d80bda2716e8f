#!/usr/bin/env bash
# CI smoke test of the end-to-end demo: the whole pipeline on the committed fixture corpus with a minuscule model,
# then a check of every artifact: shards pass the layout check, both ONNX files were written (bert-export
# checks them with the ONNX checker and, for Q/DQ, the TensorRT rules before putting them in place) and
# ran in ONNX Runtime, the calibration cache parses, and the report is valid JSON with every mode.
# Usage: tests/pipeline_smoke.sh BIN_DIR OUT_DIR
set -euo pipefail
BIN=$1 OUT=$2
cd "$(dirname "$0")/.."
rm -rf "$OUT"
BERT_BIN=$BIN bash scripts/pipeline.sh --fixture --out "$OUT" > "$OUT.log" 2>&1 || { tail -40 "$OUT.log"; exit 1; }
fail() { echo "FAIL: $*"; exit 1; }
"$BIN/bert-data" inspect "$OUT/data/shards/train" "$OUT/data/shards/heldout" --tokenizer "$OUT/data/spm.model" --show 0 >/dev/null \
  || fail "shards do not pass the layout check"
for f in export/bert-fp32.onnx export/bert-int8-qdq.onnx export/bert-fp32.tokenizer.model export/bert-fp32.trt.cache \
         fp32/checkpoint.h5 qat/checkpoint.h5 report.md plan.json training_curves.png sensitivity.png \
         triton/bert_int8/config.pbtxt triton/bert_int8/1/model.onnx triton/bert_int8/tokenizer.model; do
  [ -s "$OUT/$f" ] || fail "$f missing or empty"
done
head -c 8 "$OUT/training_curves.png" | grep -q PNG || fail "training_curves.png is not a PNG"
grep -q 'backend: "onnxruntime"' "$OUT/triton/bert_int8/config.pbtxt" || fail "Triton config"
head -1 "$OUT/export/bert-fp32.trt.cache" | grep -q '^TRT-[0-9]*-MinMaxCalibration$' || fail "calibration cache header"
grep -qE '^[^:]+: [0-9a-f]{8}$' "$OUT/export/bert-fp32.trt.cache" || fail "calibration cache entries"
python3 - "$OUT/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
modes = r["modes"]
for m in ["fp32", "ptq-max", "ptq-percentile", "ptq-entropy", "ptq-mse", "qat", "qat-int8 (engine)", "onnx-fp32 (ORT)",
          "onnx-int8-qdq (ORT)"]:
    assert m in modes, f"report lacks {m}"
h = "heldout"
# The exports score what our engine scores (argmax ties aside).
assert abs(modes["onnx-fp32 (ORT)"][h]["mlm_accuracy"] - modes["fp32"][h]["mlm_accuracy"]) < 0.005, "FP32 export disagrees"
# The report names its recipe, and the Q/DQ export's fusion report is clean (every layer INT8-ready) unless
# the sensitivity plan kept quantizers in float.
assert r["recipe"]["calibrator"] == "percentile", r.get("recipe")
assert r["fusion"]["clean"] or r["plan_keep_float"], r.get("fusion")
assert abs(modes["onnx-int8-qdq (ORT)"][h]["mlm_accuracy"] - modes["qat"][h]["mlm_accuracy"]) < 0.01, "Q/DQ export disagrees"
# Integer GEMMs give the fake-quantized model's predictions (a float-rounding tie may differ).
assert modes["qat-int8 (engine)"][h]["agreement"] >= 0.99, "INT8 inference disagrees with the fake-quantized model"
assert abs(modes["qat-int8 (engine)"][h]["mlm_accuracy"] - modes["qat"][h]["mlm_accuracy"]) < 0.005, "INT8 accuracy"
assert r["model_size"]["int8"]["deployed_megabytes"] < r["model_size"]["fp32"]["fp32_megabytes"]
# The model learned past guessing the most frequent token, so the agreements above mean something.
baseline = modes["fp32"][h]["mlm_baseline_most_frequent_token_accuracy"]
for m in ["fp32", "qat", "onnx-int8-qdq (ORT)"]:
    assert modes[m][h]["mlm_accuracy"] > 1.5 * baseline, f"{m} at {modes[m][h]['mlm_accuracy']:.4f}, baseline {baseline:.4f}"
print("report ok:", {m: round(v[h]["mlm_accuracy"], 4) for m, v in modes.items()})
PY
echo "pipeline smoke test passed ($(grep -o 'done in [0-9]*s' "$OUT.log"))"
