#!/usr/bin/env bash
# Weight scales per output channel against one per weight (`--weights per-channel|per-tensor`): BERT-tiny
# and BERT-mini pretrained past the MLM plateau on the demo data, then PTQ with every calibrator and QAT
# under each layout, against FP32 trained on for as long as QAT; held-out MLM accuracy. The per-tensor
# QAT model of the last preset is exported (Q/DQ, fusion report) and scored in ONNX Runtime beside the
# engine. Writes RESULTS_DIR/weight-scales.csv.
#   bash bench/gpu_weight_scales.sh [RESULTS_DIR]
# Needs an NVIDIA GPU, a bundle (PACK=1 bash scripts/gpu_bundle.sh) and the demo shards in cache/data
# (scripts/demo_data.sh). Environment: PRESETS ("tiny mini"), STEPS (pretraining, 10000), QAT_STEPS
# (1000), PRECISION (bf16), ORT_BATCHES (20); DEVICE (cuda) and BIN (a build's tools instead of the bundle)
# for a quick check elsewhere, e.g. DEVICE=cpu PRECISION=fp32 BIN=build/tools STEPS=20 QAT_STEPS=4.
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-runs/weight-scales}
precision=${PRECISION:-bf16}
qat_steps=${QAT_STEPS:-1000}
mkdir -p "$results"
device=${DEVICE:-cuda}
[ -n "${BIN:-}" ] || [ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
run() { if [ -n "${BIN:-}" ]; then "$BIN/$1" "${@:2}"; else bash gpu-bundle/run.sh "$@"; fi; }
D=cache/data
common=(--device "$device" --precision "$precision" --train $D/shards/train --eval $D/shards/heldout --tokenizer $D/spm.model
  --batch-size 128 --eval-every 0 --log-every 1000)
heldout() {  # NAME CHECKPOINT [bert-eval options]: held-out MLM accuracy into RESULTS/NAME.json
  local name=$1 checkpoint=$2
  shift 2
  run bert-eval --device "$device" --checkpoint "$checkpoint" --shards $D/shards/heldout --calib-shards $D/shards/train \
    --calib-batches 16 --json-out "$results/$name.json" "$@" > "$results/$name.txt"
}
last=""
for preset in ${PRESETS:-tiny mini}; do
  base=runs/$preset-$precision
  [ -f $base/checkpoint.h5 ] ||
    run bert-train "${common[@]}" --preset "$preset" --out $base --steps "${STEPS:-10000}" --lr 1e-3 --warmup 0.1 \
      --save-every 5000 2>&1 | tee "$results/$preset-train.log" | grep -E "done"
  run bert-train "${common[@]}" --init-from $base/checkpoint.h5 --out $base-fp32 --steps "$qat_steps" --lr 1e-4 \
    2>&1 | grep -E "done"
  heldout "$preset-fp32" $base --mlm-accuracy
  heldout "$preset-fp32-as-long" $base-fp32 --mlm-accuracy
  for weights in per-channel per-tensor; do
    heldout "$preset-ptq-$weights" $base --compare --weights $weights
    run bert-train "${common[@]}" --init-from $base/checkpoint.h5 --out $base-qat-$weights --steps "$qat_steps" \
      --lr 1e-4 --qat --weights $weights --calibrator percentile --calib-batches 16 2>&1 | grep -E "done|saturated"
    heldout "$preset-qat-$weights" $base-qat-$weights --mlm-accuracy
  done
  last=$base-qat-per-tensor
done
# The per-tensor QAT model as TensorRT would get it: Q/DQ export, fusion report, ONNX Runtime against the engine.
ort_script=scripts/ort_run.js
command -v node > /dev/null || ort_script=scripts/ort_run.py
run bert-export --checkpoint $last --onnx $last/mlm.onnx --qdq --masked-positions > "$results/export.txt" 2>&1
grep -E "^clean|^not clean" "$results/export.txt" || { cat "$results/export.txt"; exit 1; }
run bert-eval --device "$device" --checkpoint $last --shards $D/shards/heldout --batch-size 64 --max-batches "${ORT_BATCHES:-20}" \
  --onnx $last/mlm.onnx --ort-script $ort_script --json-out "$results/onnx.json" > "$results/onnx.txt"
python3 - "$results" ${PRESETS:-tiny mini} <<'PY'
import json, sys
results, presets = sys.argv[1], sys.argv[2:]
load = lambda name: json.load(open(f"{results}/{name}.json"))
mlm = lambda name: load(name)["metrics"]["mlm_accuracy"]
rows = [["preset", "weights", "FP32", "PTQ max", "PTQ percentile", "PTQ entropy", "PTQ mse", "QAT", "FP32 as long"]]
for preset in presets:
    for weights in ("per-channel", "per-tensor"):
        ptq = {r["mode"]: r["mlm_accuracy"] for r in load(f"{preset}-ptq-{weights}")["compare"]}
        rows.append([preset, weights, mlm(f"{preset}-fp32")] + [ptq[f"ptq-{m}"] for m in ("max", "percentile", "entropy", "mse")]
                    + [mlm(f"{preset}-qat-{weights}"), mlm(f"{preset}-fp32-as-long")])
with open(f"{results}/weight-scales.csv", "w") as f:
    for r in rows:
        f.write(",".join(x if isinstance(x, str) else f"{x:.4f}" for x in r) + "\n")
print(open(f"{results}/weight-scales.csv").read())
onnx = load("onnx")
print("ONNX Runtime / engine (per-tensor QAT, first batches):", onnx["onnx"]["mlm_accuracy"], onnx["metrics"]["mlm_accuracy"])
PY
tar -C "$(dirname "$results")" -czf "$results.tar.gz" "$(basename "$results")"  # one file to fetch
