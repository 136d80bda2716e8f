#!/usr/bin/env bash
# The Hugging Face workflow end to end on the fixtures (docs/huggingface.md):
# import tests/fixtures/hf/tiny -> shards with its vocab.txt (whole-word masking on ##) -> QAT 300 steps
# -> Q/DQ ONNX (checked by bert-export: ONNX checker + TensorRT rules) and a Hugging Face directory ->
# ONNX Runtime and the re-imported directory score what the QAT checkpoint scores.
# Usage: tests/hf_workflow.sh BIN_DIR OUT_DIR
set -euo pipefail
BIN=$1 OUT=$2
cd "$(dirname "$0")/.."
rm -rf "$OUT" && mkdir -p "$OUT"
fail() { echo "FAIL: $*"; exit 1; }
run() { "$@" >> "$OUT/log.txt" 2>&1 || { tail -30 "$OUT/log.txt"; fail "$*"; }; }
HF=tests/fixtures/hf/tiny
run "$BIN/bert-data" shards --input tests/fixtures/kjv_paragraphs.txt --format paragraphs --tokenizer "$HF" \
  --output "$OUT/shards" --max-seq-len 64 --max-predictions 10 --dupe-factor 2 --whole-word-mask
run "$BIN/bert-data" inspect "$OUT/shards" --tokenizer "$HF/vocab.txt" --show 0
run "$BIN/bert-eval" --checkpoint "$HF" --shards "$OUT/shards" --json-out "$OUT/imported.json"
# fill-mask through WordPiece: [MASK] typed in the text stays one token.
"$BIN/bert-eval" --checkpoint "$HF" --fill-mask "In the beginning God [MASK] the heaven." --top-k 3 > "$OUT/fill.txt" 2>&1 \
  || { cat "$OUT/fill.txt"; fail "fill-mask"; }
# [CLS] in the be ##g ##i ##n ##n ##ing god [MASK]: the mask is token 10.
grep -q "\[MASK\] at position 10:" "$OUT/fill.txt" || { cat "$OUT/fill.txt"; fail "fill-mask did not find [MASK] at token 10"; }
# A model directory without its vocabulary, the tokenizer named by --tokenizer: the calibrated checkpoint
# carries the tokenizer, so bert-export needs no --tokenizer.
mkdir -p "$OUT/bare" && cp "$HF"/config.json "$HF"/model.safetensors "$OUT/bare/"
run "$BIN/bert-eval" --checkpoint "$OUT/bare" --tokenizer "$HF/vocab.txt" --shards "$OUT/shards" --max-batches 2 \
  --calib-batches 2 --save-calibrated "$OUT/ptq/checkpoint.h5"
[ -s "$OUT/ptq/vocab.txt" ] || fail "the calibrated checkpoint does not carry the tokenizer"
run "$BIN/bert-export" --checkpoint "$OUT/ptq/checkpoint.h5" --onnx "$OUT/ptq.onnx" --qdq
run "$BIN/bert-train" --train "$OUT/shards" --init-from "$HF" --qat --out "$OUT/qat" --steps 300 --batch-size 16 \
  --lr 1e-3 --calib-batches 4 --log-every 100
[ -s "$OUT/qat/vocab.txt" ] || fail "the run does not carry the WordPiece vocabulary"
run "$BIN/bert-export" --checkpoint "$OUT/qat" --onnx "$OUT/export/int8.onnx" --qdq --masked-positions --hf "$OUT/hf-out"
for f in export/int8.onnx export/int8.vocab.txt hf-out/config.json hf-out/model.safetensors hf-out/quantization.json \
         hf-out/vocab.txt hf-out/tokenizer_config.json; do
  [ -s "$OUT/$f" ] || fail "$f missing or empty"
done
run "$BIN/bert-eval" --checkpoint "$OUT/qat" --shards "$OUT/shards" --onnx "$OUT/export/int8.onnx" --json-out "$OUT/qat.json"
run "$BIN/bert-eval" --checkpoint "$OUT/hf-out" --shards "$OUT/shards" --json-out "$OUT/hf-out.json"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
imported, qat, back = (json.load(open(f"{out}/{n}.json")) for n in ("imported", "qat", "hf-out"))
acc = lambda r: r["metrics"]["mlm_accuracy"]
print(f"MLM accuracy: imported {acc(imported):.4f}, after QAT {acc(qat):.4f}, "
      f"ONNX Runtime {qat['onnx']['mlm_accuracy']:.4f}, re-imported export {acc(back):.4f}")
assert acc(qat) > acc(imported) + 0.02, "300 QAT steps should teach the random fixture model something"
assert abs(qat["onnx"]["mlm_accuracy"] - acc(qat)) < 0.01, "the Q/DQ export disagrees with the engine"
assert acc(back) == acc(qat) and back["metrics"]["mlm_loss"] == qat["metrics"]["mlm_loss"], "the HF export changed the model"
assert back["quantizers_enabled"] == qat["quantizers_enabled"] > 0, "the learned scales did not come back"
PY
echo "Hugging Face workflow passed"
