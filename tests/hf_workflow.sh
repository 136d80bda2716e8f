#!/usr/bin/env bash
# The Hugging Face workflow end to end on the fixtures (docs/huggingface.md):
# import tests/fixtures/hf/tiny -> shards with its vocab.txt (whole-word masking on ##) -> QAT 300 steps
# -> Q/DQ ONNX (checked by bert-export: ONNX checker + TensorRT rules) and a Hugging Face directory ->
# ONNX Runtime and the re-imported directory score what the QAT checkpoint scores; then the same for
# question answering fine-tuned from the imported encoder, sentence pairs in GLUE's JSON layout, and a
# regression in STS-B's (a score per pair) through QAT to INT8, ONNX Runtime and a Hugging Face directory.
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

# Question answering (SQuAD's records) from the imported encoder: windows -> fine-tuning -> QAT -> a Hugging
# Face BertForQuestionAnswering directory and a Q/DQ export that answer as the checkpoint does.
python3 - "$OUT" <<'PY'
import json, random, sys
random.seed(5)
facts = [("capital of france", "paris"), ("capital of italy", "rome"), ("capital of peru", "lima"),
         ("color of the sky", "blue"), ("color of the grass", "green"), ("color of the snow", "white")]
for split, n in (("train", 600), ("dev", 60)):
    with open(f"{sys.argv[1]}/qa-{split}.jsonl", "w") as f:
        for i in range(n):
            chosen = random.sample(facts, 3)
            asked = random.randrange(3)
            context, start = "", 0
            for k, (subject, value) in enumerate(chosen):
                context += ("" if k == 0 else " ") + f"The {subject} is "
                if k == asked:
                    start = len(context)
                context += value + "."
            f.write(json.dumps({"id": f"{split}{i}", "question": f"What is the {chosen[asked][0]}?", "context": context,
                                "answers": {"text": [chosen[asked][1]], "answer_start": [start]}}) + "\n")
PY
for split in train dev; do
  run "$BIN/bert-data" task --task qa --input "$OUT/qa-$split.jsonl" --tokenizer "$HF" --output "$OUT/qa-$split.hdf5" \
    --max-seq-len 48 --doc-stride 16
done
run "$BIN/bert-train" --train "$OUT/qa-train.hdf5" --init-from "$HF" --out "$OUT/qa" --steps 300 --batch-size 32 \
  --lr 2e-3 --dropout 0 --log-every 100 --eval "$OUT/qa-dev.hdf5" --eval-qa-data "$OUT/qa-dev.jsonl" --eval-batches 0
run "$BIN/bert-train" --train "$OUT/qa-train.hdf5" --init-from "$OUT/qa" --qat --out "$OUT/qa-qat" --steps 40 \
  --batch-size 32 --lr 2e-4 --dropout 0 --calib-batches 4 --log-every 20
run "$BIN/bert-export" --checkpoint "$OUT/qa-qat" --onnx "$OUT/qa.onnx" --qdq --hf "$OUT/qa-hf"
grep -q '"BertForQuestionAnswering"' "$OUT/qa-hf/config.json" || fail "the export is not a BertForQuestionAnswering"
run "$BIN/bert-eval" --checkpoint "$OUT/qa-qat" --shards "$OUT/qa-dev.hdf5" --qa-data "$OUT/qa-dev.jsonl" \
  --predictions "$OUT/qa-answers.json" --onnx "$OUT/qa.onnx" --json-out "$OUT/qa-qat.json"
run "$BIN/bert-eval" --checkpoint "$OUT/qa-hf" --shards "$OUT/qa-dev.hdf5" --qa-data "$OUT/qa-dev.jsonl" \
  --json-out "$OUT/qa-hf.json"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
qat, back = (json.load(open(f"{out}/{n}.json")) for n in ("qa-qat", "qa-hf"))
held_out = [json.loads(line) for line in open(f"{out}/qa/metrics.jsonl") if '"eval"' in line][-1]["eval"]
assert held_out["answers"]["questions"] == 60, "bert-train --eval-qa-data did not score the dev questions"
print(f"question answering during training: exact match {held_out['answers']['exact_match']:.4f} at the end")
answers = json.load(open(f"{out}/qa-answers.json"))
print(f"question answering after QAT: exact match {qat['answers']['exact_match']:.4f}, F1 {qat['answers']['f1']:.4f} "
      f"over {qat['answers']['questions']} questions; per window {qat['metrics']['exact_match']:.4f}, "
      f"ONNX Runtime {qat['onnx']['exact_match']:.4f}")
assert qat["answers"]["questions"] == len(answers) == 60
assert qat["answers"]["exact_match"] > 0.6, "one of three facts: 300 steps should answer most questions"
assert abs(qat["onnx"]["exact_match"] - qat["metrics"]["exact_match"]) < 0.02, "the Q/DQ export disagrees"
assert abs(qat["onnx"]["answers"]["f1"] - qat["answers"]["f1"]) < 0.02, "the Q/DQ export answers otherwise"
assert back["answers"] == qat["answers"], "the Hugging Face export answers otherwise"
PY

# Sentence pairs as Hugging Face datasets write GLUE (Dataset.to_json): other field names, integer class ids
# named by --labels, a null second sentence; the label is the second sentence's, so the pair must reach the
# model. Fine-tuned, scored (Matthews correlation), exported with the names as id2label.
python3 - "$OUT" <<'PY'
import json, random, sys
random.seed(7)
facts = ["The capital of france is paris.", "The color of the sky is blue.", "The capital of peru is lima.",
         "The color of the snow is white."]
for split, n in (("train", 400), ("dev", 80)):
    with open(f"{sys.argv[1]}/pairs-{split}.jsonl", "w") as f:
        for i in range(n):
            second = random.choice(["it is so", "it is not so", None])
            f.write(json.dumps({"sentence1": random.choice(facts), "sentence2": second,
                                "label": int(second == "it is so"), "idx": i}) + "\n")
PY
printf 'not_so\nso\n' > "$OUT/pairs-labels.txt"
for split in train dev; do
  run "$BIN/bert-data" task --task seq-cls --input "$OUT/pairs-$split.jsonl" --tokenizer "$HF" \
    --output "$OUT/pairs-$split.hdf5" --max-seq-len 32 --text-fields sentence1,sentence2 --labels "$OUT/pairs-labels.txt"
done
run "$BIN/bert-train" --train "$OUT/pairs-train.hdf5" --init-from "$HF" --out "$OUT/pairs" --steps 150 --batch-size 32 \
  --lr 2e-3 --dropout 0 --log-every 50 --eval "$OUT/pairs-dev.hdf5" --eval-batches 0
run "$BIN/bert-export" --checkpoint "$OUT/pairs" --hf "$OUT/pairs-hf"
run "$BIN/bert-eval" --checkpoint "$OUT/pairs" --shards "$OUT/pairs-dev.hdf5" --compare --calibrators max \
  --calib-shards "$OUT/pairs-train.hdf5" --calib-batches 2 --rank-by mcc --json-out "$OUT/pairs.json"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = {r["mode"]: r for r in json.load(open(f"{out}/pairs.json"))["compare"]}
config = json.load(open(f"{out}/pairs-hf/config.json"))
fp32 = rows["fp32"]
print(f"sentence pairs (GLUE's layout): accuracy {fp32['accuracy']:.4f}, MCC {fp32['mcc']:.4f}, "
      f"PTQ max MCC {rows['ptq-max']['mcc']:.4f}")
assert config["id2label"] == {"0": "not_so", "1": "so"}, config["id2label"]
assert fp32["accuracy"] > 0.9 and fp32["mcc"] > 0.8, "the second sentence decides the label"
PY

# A regression in STS-B's layout (a float score per pair; 5, 2.5 or 0 by the second sentence, moved by up to
# 0.25): fine-tuned keeping the best Pearson, QAT, then the INT8 engine, the Q/DQ export in ONNX Runtime and
# the Hugging Face directory (problem_type "regression") score as the checkpoint does. The dev set is also
# ranked as a reranker's would be, each fact a query (--group-field): "it is so" must come first.
python3 - "$OUT" <<'PY'
import json, random, sys
random.seed(11)
facts = ["The capital of france is paris.", "The color of the sky is blue.", "The capital of peru is lima.",
         "The color of the snow is white."]
scores = {"it is so": 5.0, "it is partly so": 2.5, "it is not so": 0.0}
for split, n in (("train", 400), ("dev", 80)):
    with open(f"{sys.argv[1]}/sts-{split}.jsonl", "w") as f:
        for i in range(n):
            second = random.choice(sorted(scores))
            f.write(json.dumps({"sentence1": random.choice(facts), "sentence2": second,
                                "label": round(scores[second] + random.uniform(-0.25, 0.25), 3), "idx": i}) + "\n")
PY
for split in train dev; do
  run "$BIN/bert-data" task --task seq-reg --input "$OUT/sts-$split.jsonl" --tokenizer "$HF" \
    --output "$OUT/sts-$split.hdf5" --max-seq-len 32 --text-fields sentence1,sentence2
done
run "$BIN/bert-data" task --task seq-reg --input "$OUT/sts-dev.jsonl" --tokenizer "$HF" \
  --output "$OUT/sts-ranked.hdf5" --max-seq-len 32 --text-fields sentence1,sentence2 --group-field sentence1
"$BIN/bert-data" inspect "$OUT/sts-dev.hdf5" --tokenizer "$HF/vocab.txt" --show 1 > "$OUT/sts-inspect.txt" 2>&1
grep -q "80 seq-reg examples" "$OUT/sts-inspect.txt" || fail "bert-data inspect does not describe the scores"
run "$BIN/bert-train" --train "$OUT/sts-train.hdf5" --init-from "$HF" --out "$OUT/sts" --steps 150 --batch-size 32 \
  --lr 2e-3 --dropout 0 --log-every 50 --eval "$OUT/sts-dev.hdf5" --eval-batches 0 --eval-every 50 --keep-best pearson
run "$BIN/bert-train" --train "$OUT/sts-train.hdf5" --init-from "$OUT/sts/checkpoint-best.h5" --qat --out "$OUT/sts-qat" \
  --steps 40 --batch-size 32 --lr 2e-4 --dropout 0 --calib-batches 4 --log-every 20
run "$BIN/bert-export" --checkpoint "$OUT/sts-qat" --onnx "$OUT/sts.onnx" --qdq --hf "$OUT/sts-hf"
run "$BIN/bert-eval" --checkpoint "$OUT/sts-qat" --shards "$OUT/sts-dev.hdf5" --onnx "$OUT/sts.onnx" --int8 \
  --json-out "$OUT/sts-qat.json"
run "$BIN/bert-eval" --checkpoint "$OUT/sts-hf" --shards "$OUT/sts-dev.hdf5" --json-out "$OUT/sts-hf.json" \
  --predictions "$OUT/sts-scores.jsonl"
run "$BIN/bert-eval" --checkpoint "$OUT/sts-qat" --shards "$OUT/sts-ranked.hdf5" --onnx "$OUT/sts.onnx" \
  --json-out "$OUT/sts-ranked.json"
run "$BIN/bert-eval" --checkpoint "$OUT/sts" --shards "$OUT/sts-dev.hdf5" --compare --calibrators max \
  --calib-shards "$OUT/sts-train.hdf5" --calib-batches 2 --json-out "$OUT/sts-compare.json"
# Per-quantizer sensitivity ranked as a reranker's (--rank-by ndcg); MRR or NDCG asked of shards without
# groups is refused, naming the shard.
run "$BIN/bert-eval" --checkpoint "$OUT/sts" --shards "$OUT/sts-ranked.hdf5" --json-out "$OUT/sts-ranked-fp32.json"
run "$BIN/bert-eval" --checkpoint "$OUT/sts" --shards "$OUT/sts-ranked.hdf5" --sensitivity --rank-by ndcg \
  --calib-shards "$OUT/sts-train.hdf5" --calib-batches 2 --json-out "$OUT/sts-sensitivity.json"
if "$BIN/bert-eval" --checkpoint "$OUT/sts" --shards "$OUT/sts-dev.hdf5" --compare --rank-by mrr \
  --calib-shards "$OUT/sts-train.hdf5" --calib-batches 2 > "$OUT/sts-mrr-error.txt" 2>&1; then
  fail "--rank-by mrr ran on shards without groups"
fi
grep -q "sts-dev.hdf5' has no groups" "$OUT/sts-mrr-error.txt" || { cat "$OUT/sts-mrr-error.txt"; fail "--rank-by mrr without groups: no clear error"; }
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
qat, back, compare, ranked = (json.load(open(f"{out}/{n}.json")) for n in ("sts-qat", "sts-hf", "sts-compare", "sts-ranked"))
best = json.load(open(f"{out}/sts/best.json"))
config = json.load(open(f"{out}/sts-hf/config.json"))
m = {r["mode"]: r for r in qat["int8"]["modes"]}["fake-quant"]
m = {k: v for k, v in m.items() if k in back["metrics"]}
print(f"regression (STS-B's layout): best Pearson {best['value']:.4f} at step {best['step']}; after QAT Pearson "
      f"{m['pearson']:.4f}, Spearman {m['spearman']:.4f}, MSE {m['mse']:.4f} (the mean's {m['baseline_mean_mse']:.4f}); "
      f"ONNX Runtime Pearson {qat['onnx']['pearson']:.4f}; INT8 scores within "
      f"{qat['int8']['max_score_difference_from_fake_quant']:.4g} of fake-quant")
assert best["metric"] == "pearson"
assert config["problem_type"] == "regression" and len(config["id2label"]) == 1, config
assert m["pearson"] > 0.95 and m["mse"] < 0.2 * m["baseline_mean_mse"], "the second sentence decides the score"
assert abs(qat["onnx"]["pearson"] - m["pearson"]) < 0.01 and abs(qat["onnx"]["mse"] - m["mse"]) < 0.05, \
    "the Q/DQ export scores otherwise"
assert qat["int8"]["max_score_difference_from_fake_quant"] < 0.05, "the INT8 engine moves the scores"
assert back["metrics"] == m, "the Hugging Face export scores otherwise"
rows = {r["mode"]: r for r in compare["compare"]}
assert abs(rows["ptq-max"]["pearson"] - rows["fp32"]["pearson"]) < 0.02, "PTQ loses the correlation"
lines = [json.loads(line) for line in open(f"{out}/sts-scores.jsonl")]
assert [line["index"] for line in lines] == list(range(80)), "--predictions: a line per sequence, in order"
targets = [json.loads(line)["label"] for line in open(f"{out}/sts-dev.jsonl")]
assert all(abs(line["target"] - t) < 1e-6 for line, t in zip(lines, targets)), "the targets are the input's scores"
def pearson(x, y):
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    return sxy / (sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y)) ** 0.5
assert abs(pearson([l["score"] for l in lines], targets) - back["metrics"]["pearson"]) < 1e-5
sensitivity, fp32_ranked = (json.load(open(f"{out}/{n}.json")) for n in ("sts-sensitivity", "sts-ranked-fp32"))
sensitivity = sensitivity["sensitivity"]
assert sensitivity["metric"] == "task NDCG@10", sensitivity["metric"]
assert abs(sensitivity["fp32"] - fp32_ranked["metrics"]["ndcg_at_10"]) < 1e-12, "--rank-by ndcg ranks by another number"
print(f"sensitivity by NDCG@10: FP32 {sensitivity['fp32']:.4f}, all quantized {sensitivity['all_quantized']:.4f}")
r = ranked["metrics"]
print(f"ranked as a reranker (4 facts, 20 answers each): MRR@10 {r['mrr_at_10']:.4f}, NDCG@10 {r['ndcg_at_10']:.4f}; "
      f"ONNX Runtime {ranked['onnx']['mrr_at_10']:.4f}, {ranked['onnx']['ndcg_at_10']:.4f}")
assert r["ranked_groups"] == 4 and r["mrr_at_10"] == 1.0 and r["ndcg_at_10"] > 0.95, r
assert r["pearson"] == m["pearson"], "the same examples, grouped"
assert ranked["onnx"]["mrr_at_10"] == 1.0 and abs(ranked["onnx"]["ndcg_at_10"] - r["ndcg_at_10"]) < 0.01
PY
echo "Hugging Face workflow passed"
