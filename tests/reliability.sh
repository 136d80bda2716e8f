#!/usr/bin/env bash
# Tool-level reliability, on the fixture corpus and a minute model:
#   bad input   every tool exits non-zero with a message naming the file or flag, and writes nothing;
#   signals     SIGINT / SIGTERM during training: checkpoint, exit 130 / 143; --resume then finishes
#               with exactly the model of an uninterrupted run;
#   disk full   a write that fails (file-size limit: ulimit -f, the same EFBIG/ENOSPC path as a full
#               disk) during a checkpoint, a shard or an export leaves the previous file intact and
#               no temporary behind, and the error says so.
# Usage: tests/reliability.sh BIN_DIR OUT_DIR
set -uo pipefail
BIN=$1 OUT=$2
cd "$(dirname "$0")/.."
rm -rf "$OUT" && mkdir -p "$OUT"
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }
CORPUS=tests/fixtures/kjv_paragraphs.txt
VOCAB=tests/fixtures/hf/tiny/vocab.txt
cat > "$OUT/tiny.json" <<'JSON'
{"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
 "max_position_embeddings": 64, "vocab_size": 384}
JSON
"$BIN/bert-data" shards --input $CORPUS --format paragraphs --tokenizer $VOCAB --output "$OUT/shards" \
  --max-seq-len 64 --max-predictions 10 --dupe-factor 1 > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
SHARD=$(ls "$OUT"/shards/*.hdf5 | head -1)
T=("$BIN/bert-train" --log-every 50)
SH=(--train "$OUT/shards")
TOK=(--tokenizer $VOCAB)
CFG=(--config "$OUT/tiny.json")
TRAIN=("${T[@]}" "${SH[@]}" "${TOK[@]}" "${CFG[@]}" --batch-size 32)

# --list-devices answers without the required flags: "cpu" first, then one "cuda:N (name, memory)" a GPU.
for tool in bert-train bert-eval; do
  devices=$("$BIN/$tool" --list-devices 2>&1) || fail "$tool --list-devices: exit code $?"
  [ "$(echo "$devices" | head -1)" = cpu ] || fail "$tool --list-devices: first line '$(echo "$devices" | head -1)', not 'cpu'"
  echo "$devices" | tail -n +2 | grep -v -q -E '^cuda:[0-9]+ \(' && fail "$tool --list-devices: a line neither cpu nor cuda:N: $devices"
done

# expect_error NAME FRAGMENT MUST_NOT_EXIST -- COMMAND...: non-zero exit, FRAGMENT in the output, and
# MUST_NOT_EXIST (a path the command would have created) absent afterwards.
expect_error() {
  local name=$1 fragment=$2 absent=$3
  shift 4
  local log="$OUT/bad-$name.log"
  "$@" > "$log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] || fail "$name: exit code 0"
  [ $rc -lt 128 ] || fail "$name: killed by a signal (exit $rc), not a clean error"
  grep -qF -- "$fragment" "$log" || fail "$name: message lacks '$fragment': $(tail -2 "$log")"
  [ -z "$absent" ] || [ ! -e "$absent" ] || fail "$name: '$absent' was written"
}

# ---- bad input
N="$OUT/never"  # no bad-input command may create it
expect_error missing-shards "does-not-exist" "$N" -- "${T[@]}" "${TOK[@]}" "${CFG[@]}" --train "$OUT/does-not-exist" --out "$N" --steps 5
printf 'not an HDF5 file at all' > "$OUT/corrupt.hdf5"
expect_error corrupt-shard "corrupt.hdf5' is not an HDF5 file" "$N" -- "${T[@]}" "${TOK[@]}" "${CFG[@]}" --train "$OUT/corrupt.hdf5" --out "$N" --steps 5
head -c 3000 "$SHARD" > "$OUT/truncated.hdf5"
expect_error truncated-shard "truncated.hdf5" "$N" -- "${T[@]}" "${TOK[@]}" "${CFG[@]}" --train "$OUT/truncated.hdf5" --out "$N" --steps 5
expect_error missing-tokenizer "no-such-vocab.txt' does not exist" "$N" -- "${T[@]}" "${SH[@]}" "${CFG[@]}" --tokenizer "$OUT/no-such-vocab.txt" --out "$N" --steps 5
sed 's/"max_position_embeddings": 64/"max_position_embeddings": 32/' "$OUT/tiny.json" > "$OUT/short.json"
expect_error seq-longer-than-model "longer than" "$N" -- "${T[@]}" "${SH[@]}" "${TOK[@]}" --config "$OUT/short.json" --out "$N" --steps 5
sed 's/"num_attention_heads": 2/"num_attention_heads": 3/' "$OUT/tiny.json" > "$OUT/heads.json"
expect_error heads-do-not-divide "hidden_size 32 is not divisible by num_attention_heads 3" "$N" -- "${T[@]}" "${SH[@]}" "${TOK[@]}" --config "$OUT/heads.json" --out "$N" --steps 5
expect_error config-is-a-directory "cannot read model config" "$N" -- "${T[@]}" "${SH[@]}" "${TOK[@]}" --config "$OUT/shards" --out "$N" --steps 5
if [ "$(id -u)" -ne 0 ]; then  # root reads any file: only an ordinary user can test permissions
  cp "$OUT/tiny.json" "$OUT/unreadable.json" && chmod 000 "$OUT/unreadable.json"
  expect_error unreadable-config "unreadable.json" "$N" -- "${T[@]}" "${SH[@]}" "${TOK[@]}" --config "$OUT/unreadable.json" --out "$N" --steps 5
fi
printf '{"hidden_size": ' > "$OUT/broken.json"
expect_error broken-config "broken.json" "$N" -- "${T[@]}" "${SH[@]}" "${TOK[@]}" --config "$OUT/broken.json" --out "$N" --steps 5
expect_error unknown-preset "unknown model preset 'huge'" "$N" -- "${T[@]}" "${SH[@]}" "${TOK[@]}" --preset huge --out "$N" --steps 5
expect_error negative-steps "--steps -5" "$N" -- "${TRAIN[@]}" --out "$N" --steps -5
expect_error zero-batch "--batch-size 0" "$N" -- "${T[@]}" "${SH[@]}" "${TOK[@]}" "${CFG[@]}" --out "$N" --steps 5 --batch-size 0
expect_error nan-lr "--lr" "$N" -- "${TRAIN[@]}" --out "$N" --steps 5 --lr nan
expect_error bad-cpu-kernels "BERT_CPU_KERNELS='avx1024': expected 'build', 'avx2' or 'avx512'" "$N" -- \
  env BERT_CPU_KERNELS=avx1024 "${TRAIN[@]}" --out "$N" --steps 5
sed '300s/.*/zzzzz/' $VOCAB > "$OUT/vocab.txt"  # same size, another vocabulary
expect_error other-tokenizer "made with another tokenizer" "$N" -- "${T[@]}" "${SH[@]}" "${CFG[@]}" --tokenizer "$OUT/vocab.txt" --out "$N" --steps 5
expect_error bad-on-nonfinite "--on-nonfinite 'maybe'" "$N" -- "${TRAIN[@]}" --out "$N" --steps 5 --on-nonfinite maybe
expect_error data-missing-input "nowhere.txt" "$OUT/never-shards" -- "$BIN/bert-data" shards --input "$OUT/nowhere.txt" --tokenizer $VOCAB --output "$OUT/never-shards"
expect_error data-bad-seq "--max-seq-len" "$OUT/never-shards" -- "$BIN/bert-data" shards --input $CORPUS --tokenizer $VOCAB --output "$OUT/never-shards" --max-seq-len 3
expect_error data-inspect-corrupt "corrupt.hdf5" "" -- "$BIN/bert-data" inspect "$OUT/corrupt.hdf5"
# Question answering: an answer outside its context (file and line), a window with no room, labels for qa.
printf '%s\n' '{"question": "who?", "context": "Mary wrote it.", "answers": {"text": ["Mary"], "answer_start": [0]}}' \
  '{"question": "what?", "context": "short", "answers": [{"text": "short", "answer_start": 9}]}' > "$OUT/qa.jsonl"
expect_error qa-answer-outside "qa.jsonl:2: answer_start 9" "$OUT/never-qa.hdf5" -- "$BIN/bert-data" task --task qa --input "$OUT/qa.jsonl" --tokenizer $VOCAB --output "$OUT/never-qa.hdf5"
head -1 "$OUT/qa.jsonl" > "$OUT/qa1.jsonl"
expect_error qa-no-room "leaves no room for the context" "$OUT/never-qa.hdf5" -- "$BIN/bert-data" task --task qa --input "$OUT/qa1.jsonl" --tokenizer $VOCAB --output "$OUT/never-qa.hdf5" --max-seq-len 5
expect_error qa-labels "--labels: a qa shard has no label set" "$OUT/never-qa.hdf5" -- "$BIN/bert-data" task --task qa --input "$OUT/qa1.jsonl" --tokenizer $VOCAB --output "$OUT/never-qa.hdf5" --labels "$OUT/qa1.jsonl"
expect_error qa-task "--task 'squad': expected seq-cls, token-cls, qa or seq-reg" "$OUT/never-qa.hdf5" -- "$BIN/bert-data" task --task squad --input "$OUT/qa1.jsonl" --tokenizer $VOCAB --output "$OUT/never-qa.hdf5"

# A small trained model for the evaluation, export and interruption cases.
"${TRAIN[@]}" --out "$OUT/run" --steps 20 > "$OUT/run.log" 2>&1 || { tail "$OUT/run.log"; exit 1; }

# --resume keeps the run's plan: a 12-step run stopped at 8 resumes to 12 (not the default 2,000) with its
# learning rate; a changed --lr is refused; a longer --steps extends it with a warning naming both.
"${TRAIN[@]}" --out "$OUT/plan" --steps 12 --lr 3e-4 --stop-at 8 > "$OUT/plan.log" 2>&1 || fail "planned run: $(tail -2 "$OUT/plan.log")"
expect_error resume-other-lr "--lr 0.001: the run being resumed was planned with 0.0003" "" -- "${TRAIN[@]}" --out "$OUT/plan" --resume --lr 1e-3
"${TRAIN[@]}" --out "$OUT/plan" --resume > "$OUT/plan-resume.log" 2>&1 || fail "resume: $(tail -2 "$OUT/plan-resume.log")"
grep -q "done: 4 steps" "$OUT/plan-resume.log" && grep -q "step .*12/12" "$OUT/plan-resume.log" ||
  fail "--resume without --steps did not finish the planned 12 steps: $(grep -E 'step|done' "$OUT/plan-resume.log" | tail -3)"
"${TRAIN[@]}" --out "$OUT/plan" --resume --steps 14 > "$OUT/plan-extend.log" 2>&1 || fail "extend: $(tail -2 "$OUT/plan-extend.log")"
grep -q -- "--steps changed on resume: 12 -> 14" "$OUT/plan-extend.log" && grep -q "done: 2 steps" "$OUT/plan-extend.log" ||
  fail "--resume --steps 14: $(grep -E 'warn|done' "$OUT/plan-extend.log" | tail -3)"
expect_error eval-missing-checkpoint "nothing.h5" "" -- "$BIN/bert-eval" --checkpoint "$OUT/nothing.h5" --shards "$OUT/shards"
expect_error eval-corrupt-checkpoint "corrupt.hdf5' is not an HDF5 file" "" -- "$BIN/bert-eval" --checkpoint "$OUT/corrupt.hdf5" --shards "$OUT/shards"
expect_error eval-unknown-quantizer "no-such-quantizer" "$OUT/never.h5" -- "$BIN/bert-eval" --checkpoint "$OUT/run" --shards "$OUT/shards" --quantize 'no-such-quantizer*' --save-calibrated "$OUT/never.h5"
expect_error eval-wrong-shards "vocabulary of 800 tokens; the model has 384" "" -- "$BIN/bert-eval" --checkpoint tests/fixtures/hf/tiny-bf16 --shards tests/fixtures/kjv_seq32_vocab800.hdf5
expect_error export-no-quantizers "has no enabled quantizers" "$OUT/never.onnx" -- "$BIN/bert-export" --checkpoint "$OUT/run" --onnx "$OUT/never.onnx" --qdq
expect_error export-bad-opset "--opset" "$OUT/never.onnx" -- "$BIN/bert-export" --checkpoint "$OUT/run" --onnx "$OUT/never.onnx" --opset 7
expect_error export-nothing "nothing to do" "" -- "$BIN/bert-export" --checkpoint "$OUT/run"
"$BIN/bert-eval" --checkpoint "$OUT/run" --shards "$OUT/shards" --calib-batches 2 --save-calibrated "$OUT/ptq.h5" > "$OUT/ptq.log" 2>&1 ||
  { tail "$OUT/ptq.log"; fail "save-calibrated"; }
expect_error export-cache-with-qdq "TensorRT ignores calibration" "$OUT/never.onnx" -- "$BIN/bert-export" --checkpoint "$OUT/ptq.h5" \
  --onnx "$OUT/never.onnx" --qdq --trt-calib-cache "$OUT/never.cache" --calib-shards "$OUT/shards"
expect_error export-cache-of-quantized "enabled quantizers (QAT or PTQ)" "$OUT/never.cache" -- "$BIN/bert-export" \
  --checkpoint "$OUT/ptq.h5" --onnx "$OUT/never.onnx" --trt-calib-cache "$OUT/never.cache" --calib-shards "$OUT/shards"
expect_error eval-int8-of-fp32 "has no enabled quantizers (an FP32 model)" "" -- "$BIN/bert-eval" --checkpoint "$OUT/run" \
  --shards "$OUT/shards" --int8
expect_error eval-qa-data-of-pretraining "is a BertForPreTraining, not a question-answering model" "" -- "$BIN/bert-eval" \
  --checkpoint "$OUT/run" --shards "$OUT/shards" --qa-data "$OUT/qa1.jsonl"
expect_error eval-predictions-of-pretraining "is a pretraining model; a task model's predictions are written" \
  "$OUT/never.json" -- "$BIN/bert-eval" --checkpoint "$OUT/run" --shards "$OUT/shards" --predictions "$OUT/never.json"
expect_error eval-rank-by-of-pretraining "--rank-by mcc: a pretraining model is ranked by its MLM accuracy" \
  "$OUT/never.json" -- "$BIN/bert-eval" --checkpoint "$OUT/run" --shards "$OUT/shards" --sensitivity --rank-by mcc \
  --plan-out "$OUT/never.json"
expect_error train-keep-best-without-eval "--keep-best loss needs --eval" "$N" -- "${T[@]}" "${SH[@]}" "${TOK[@]}" \
  "${CFG[@]}" --out "$N" --steps 5 --keep-best loss
expect_error eval-rank-by-alone "--rank-by macro-f1 goes with --sensitivity or --compare" "" -- "$BIN/bert-eval" \
  --checkpoint "$OUT/run" --shards "$OUT/shards" --rank-by macro-f1
# INT8 on a GPU where none is visible: the device's error, before any work.
if ! echo "$devices" | grep -q '^cuda:'; then
  expect_error eval-int8-on-gpu "--device cuda: " "" -- "$BIN/bert-eval" --checkpoint "$OUT/ptq.h5" \
    --shards "$OUT/shards" --int8 --device cuda
fi
expect_error eval-int8-compare "not with --compare" "" -- "$BIN/bert-eval" --checkpoint "$OUT/ptq.h5" \
  --shards "$OUT/shards" --int8 --compare
expect_error eval-int8-decoder-alone "--int8-decoder goes with --int8" "" -- "$BIN/bert-eval" --checkpoint "$OUT/ptq.h5" \
  --shards "$OUT/shards" --int8-decoder
"$BIN/bert-eval" --checkpoint "$OUT/ptq.h5" --shards "$OUT/shards" --int8 --int8-decoder --max-batches 2 > "$OUT/int8-decoder.log" 2>&1 ||
  { tail "$OUT/int8-decoder.log"; fail "--int8 --int8-decoder"; }
grep -q "the MLM decoder among them" "$OUT/int8-decoder.log" && grep -q "^int8 " "$OUT/int8-decoder.log" ||
  fail "--int8 --int8-decoder: no INT8 row or no word of the decoder: $(cat "$OUT/int8-decoder.log")"
"$BIN/bert-eval" --checkpoint "$OUT/ptq.h5" --fill-mask "and god [MASK] the light" --int8 > "$OUT/int8-fill.log" 2>&1 ||
  { tail "$OUT/int8-fill.log"; fail "--int8 --fill-mask"; }
grep -q "\[MASK\] at position" "$OUT/int8-fill.log" || fail "--int8 --fill-mask printed no candidates"
# --compare flags a row that loses more than --flag-drop and names the activation quantizers behind it
# (a 30th-percentile calibration clips most activations: it must lose, and be traced).
"$BIN/bert-eval" --checkpoint "$OUT/run" --shards "$OUT/shards" --compare --calib-batches 2 --calibrators max,percentile \
  --percentile 30 --flag-drop 0 --flag-names 2 --json --json-out "$OUT/flagged.json" > "$OUT/flagged.log" 2>&1 ||
  { tail "$OUT/flagged.log"; fail "--compare --flag-drop"; }
python3 - "$OUT/flagged.json" <<'PY' || fail "--compare --flag-drop: $(cat "$OUT/flagged.log")"
import json, sys
rows = {r["mode"]: r for r in json.load(open(sys.argv[1]))["compare"]}
fp32 = rows["fp32"]["mlm_accuracy"]
assert "flagged" not in rows["fp32"]
for mode, r in rows.items():
    assert r.get("flagged", False) == (r["mlm_accuracy"] < fp32), mode
    if r.get("flagged") and mode.startswith("ptq-"):
        names = [q["name"] for q in r["responsible"]]
        assert len(names) == 2 and all("weight_quantizer" not in n for n in names), names
        assert r["responsible"][0]["only_this"] <= r["responsible"][1]["only_this"]
assert rows["ptq-percentile"].get("flagged"), "a 30th-percentile calibration lost nothing"
PY
expect_error eval-calibration-takes-all "all needed for calibration" "" -- "$BIN/bert-eval" --checkpoint "$OUT/run" \
  --shards "$OUT/shards" --compare --calib-batches 100000
expect_error bad-scales "--scales 'log'" "$N" -- "${TRAIN[@]}" --out "$N" --steps 5 --scales log

# ---- signals: interrupt a long run, resume it, compare with the uninterrupted run.
# Batches of 8: the 750 steps left after the signal take about 3 s in a release build (the signal must
# come before the end) and each run 25 s under the sanitizers (batches of 32: 90 s).
STEPS=800
LONG=("${T[@]}" "${SH[@]}" "${TOK[@]}" "${CFG[@]}" --batch-size 8)
"${LONG[@]}" --out "$OUT/full" --steps $STEPS --save-every 0 --seed 3 > "$OUT/full.log" 2>&1 || fail "uninterrupted run"
for sig in INT TERM; do
  want=$([ $sig = INT ] && echo 130 || echo 143)
  "${LONG[@]}" --out "$OUT/sig-$sig" --steps $STEPS --save-every 0 --seed 3 > "$OUT/sig-$sig.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do grep -q "step .*50/$STEPS" "$OUT/sig-$sig.log" 2>/dev/null && break; sleep 0.1; done
  kill -$sig $pid
  wait $pid
  rc=$?
  [ $rc -eq $want ] || fail "SIG$sig: exit $rc, expected $want"
  grep -q "continue with --resume" "$OUT/sig-$sig.log" || fail "SIG$sig: no stop message"
  [ -s "$OUT/sig-$sig/checkpoint.h5" ] || fail "SIG$sig: no checkpoint"
  "${LONG[@]}" --out "$OUT/sig-$sig" --steps $STEPS --save-every 0 --seed 3 --resume >> "$OUT/sig-$sig.log" 2>&1 || fail "SIG$sig: resume"
  for run in full sig-$sig; do
    "$BIN/bert-eval" --checkpoint "$OUT/$run" --shards "$OUT/shards" --json-out "$OUT/$run.json" > /dev/null 2>&1 || fail "eval $run"
  done
  # --json: stdout is the JSON report alone (logs go to stderr), so it pipes into a JSON reader.
  "$BIN/bert-eval" --checkpoint "$OUT/full" --shards "$OUT/shards" --json 2> /dev/null |
    python3 -c 'import json, sys; json.load(sys.stdin)' || fail "bert-eval --json: stdout is not JSON alone"
  python3 - "$OUT/full.json" "$OUT/sig-$sig.json" <<'PY' || fail "SIG$sig: the resumed model differs from the uninterrupted one"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
assert a["step"] == b["step"], (a["step"], b["step"])
assert a["metrics"] == b["metrics"], (a["metrics"], b["metrics"])
PY
done

# ---- disk full: a file-size limit makes the next write fail with EFBIG, as ENOSPC would.
limited() { (ulimit -f "$1"; trap '' XFSZ; shift; "$@"); }
sum() { sha256sum "$1" | cut -d' ' -f1; }
before=$(sum "$OUT/run/checkpoint.h5")
limited 64 "${TRAIN[@]}" --out "$OUT/run" --steps 25 --resume > "$OUT/full-checkpoint.log" 2>&1
rc=$?
[ $rc -eq 1 ] || fail "checkpoint: exit $rc under the limit, expected 1 (a clean error)"
grep -qE "disk full|File too large|cannot (write|flush)" "$OUT/full-checkpoint.log" || fail "checkpoint: no disk-full message: $(tail -2 "$OUT/full-checkpoint.log")"
[ "$(sum "$OUT/run/checkpoint.h5")" = "$before" ] || fail "checkpoint: the previous checkpoint changed"
ls "$OUT"/run/*.tmp.* > /dev/null 2>&1 && fail "checkpoint: a temporary file was left behind"
"$BIN/bert-export" --checkpoint "$OUT/run" --onnx "$OUT/export/model.onnx" > "$OUT/export.log" 2>&1 || fail "export"
before=$(sum "$OUT/export/model.onnx")
limited 8 "$BIN/bert-export" --checkpoint "$OUT/run" --onnx "$OUT/export/model.onnx" > "$OUT/full-export.log" 2>&1
rc=$?
[ $rc -eq 1 ] || fail "export: exit $rc under the limit, expected 1"
grep -qE "disk full|cannot write" "$OUT/full-export.log" || fail "export: no disk-full message: $(tail -2 "$OUT/full-export.log")"
[ "$(sum "$OUT/export/model.onnx")" = "$before" ] || fail "export: the previous file changed"
ls "$OUT"/export/*.tmp.* > /dev/null 2>&1 && fail "export: a temporary file was left behind"
# The fusion report: of a Q/DQ export (clean here: every GEMM and attention matmul INT8), and clear
# refusals for an FP32 graph, a file that is no ONNX model and a report asked beside an export.
"$BIN/bert-export" --checkpoint "$OUT/ptq.h5" --onnx "$OUT/export/qdq.onnx" --qdq --report-json "$OUT/fusion.json" \
  > "$OUT/qdq-export.log" 2>&1 || fail "Q/DQ export: $(tail -2 "$OUT/qdq-export.log")"
grep -q "^clean: every GEMM" "$OUT/qdq-export.log" || fail "Q/DQ export: no clean fusion report: $(cat "$OUT/qdq-export.log")"
"$BIN/bert-export" --report "$OUT/export/qdq.onnx" > "$OUT/fusion.log" 2>&1 && grep -q "^0 .*fused int8" "$OUT/fusion.log" ||
  fail "--report: $(cat "$OUT/fusion.log")"
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['clean'] and len(r['layers'])==1" "$OUT/fusion.json" ||
  fail "--report-json"
# Per-tensor weight scales (--weights): PTQ saved, run as integers, exported with a clean fusion report;
# refused without a quantization to choose for, on an already quantized model, and for FP32 training.
"$BIN/bert-eval" --checkpoint "$OUT/run" --shards "$OUT/shards" --calib-batches 2 --weights per-tensor \
  --save-calibrated "$OUT/ptq-tensor.h5" > "$OUT/ptq-tensor.log" 2>&1 || fail "--weights per-tensor: $(tail -2 "$OUT/ptq-tensor.log")"
"$BIN/bert-eval" --checkpoint "$OUT/ptq-tensor.h5" --shards "$OUT/shards" --int8 --max-batches 2 > "$OUT/int8-tensor.log" 2>&1 &&
  grep -q "^int8 " "$OUT/int8-tensor.log" || fail "--int8 of a per-tensor model: $(tail -3 "$OUT/int8-tensor.log")"
"$BIN/bert-export" --checkpoint "$OUT/ptq-tensor.h5" --onnx "$OUT/export/qdq-tensor.onnx" --qdq > "$OUT/qdq-tensor.log" 2>&1 &&
  grep -q "^clean: every GEMM" "$OUT/qdq-tensor.log" || fail "per-tensor Q/DQ export: $(tail -3 "$OUT/qdq-tensor.log")"
expect_error eval-weights-alone "chooses the weight scales of post-training quantization" "" -- "$BIN/bert-eval" \
  --checkpoint "$OUT/run" --shards "$OUT/shards" --weights per-tensor
expect_error eval-weights-of-quantized "quantizes weights per-channel" "" -- "$BIN/bert-eval" --checkpoint "$OUT/ptq.h5" \
  --shards "$OUT/shards" --compare --weights per-tensor
expect_error eval-weights-bad "--weights" "" -- "$BIN/bert-eval" --checkpoint "$OUT/run" --shards "$OUT/shards" \
  --compare --weights per-row
expect_error train-weights-without-qat "it goes with --qat" "$N" -- "${TRAIN[@]}" --out "$N" --steps 5 --weights per-tensor
expect_error report-fp32 "no QuantizeLinear/DequantizeLinear: an FP32 graph" "" -- "$BIN/bert-export" --report "$OUT/export/model.onnx"
expect_error report-not-onnx "is not an ONNX model" "" -- "$BIN/bert-export" --report "$OUT/tiny.json"
expect_error report-and-export "--report reads an ONNX file and exports nothing" "" -- "$BIN/bert-export" \
  --report "$OUT/export/qdq.onnx" --checkpoint "$OUT/run"
EVAL_JSON=("$BIN/bert-eval" --checkpoint "$OUT/run" --shards "$OUT/shards" --fill-mask "and god [MASK] the light" --top-k 40 --json-out "$OUT/report.json")
"${EVAL_JSON[@]}" > "$OUT/report.log" 2>&1 || fail "eval --json-out"
before=$(sum "$OUT/report.json")
[ "$(stat -c %s "$OUT/report.json")" -gt 1024 ] || fail "report.json is too small to exceed the 1 KB limit"
limited 1 "${EVAL_JSON[@]}" 2>&1 | cat > "$OUT/full-json.log"  # through a pipe: the log itself is not limited
rc=${PIPESTATUS[0]}
[ $rc -eq 1 ] || fail "json-out: exit $rc under the limit, expected 1"
grep -qE "disk full" "$OUT/full-json.log" || fail "json-out: no disk-full message: $(tail -2 "$OUT/full-json.log")"
[ "$(sum "$OUT/report.json")" = "$before" ] || fail "json-out: the previous report changed"
before=$(sum "$SHARD")
limited 16 "$BIN/bert-data" shards --input $CORPUS --format paragraphs --tokenizer $VOCAB --output "$OUT/shards" \
  --max-seq-len 64 --max-predictions 10 --dupe-factor 1 > "$OUT/full-shards.log" 2>&1
rc=$?
[ $rc -eq 1 ] || fail "shards: exit $rc under the limit, expected 1"
grep -qE "disk full|cannot write|File too large" "$OUT/full-shards.log" || fail "shards: no disk-full message: $(tail -2 "$OUT/full-shards.log")"
[ "$(sum "$SHARD")" = "$before" ] || fail "shards: the previous shard changed"
ls "$OUT"/shards/*.tmp.* > /dev/null 2>&1 && fail "shards: a temporary file was left behind"

[ $FAILED -eq 0 ] && echo "reliability checks passed" || exit 1
