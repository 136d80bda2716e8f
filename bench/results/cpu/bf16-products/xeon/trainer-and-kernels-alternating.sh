#!/usr/bin/env bash
# The GPU machine's Xeon, 16 threads, three rounds alternating (the machine's speed drifts within a call):
# train-step-bench --precision bf16 (AMX) against bert-train --precision bf16 (FP32 master weights, then QAT),
# tiny, batch 128; and the BF16 training step on vdpbf16ps and on rounded copies (BERT_BF16_PRODUCTS) beside
# the FP32 step. From the repository root with $OUT set; gpu-bundle.tar.xz and cache/xeon carried.
set -uo pipefail
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
r="bash gpu-bundle/run.sh"
export OMP_NUM_THREADS=16 OMP_WAIT_POLICY=passive
D=cache/xeon
step() { $r train-step-bench --presets tiny --batches 128 --modes "$1" --steps 5 --warmup 2 "${@:2}" 2>&1 | grep -E "^tiny"; }
for round in 1 2 3; do
  echo "== round $round"
  step fp32,qat --precision bf16 | sed "s/^/bench amx /"
  rm -rf runs/bf16 runs/bf16-qat
  $r bert-train --device cpu --precision bf16 --preset tiny --train $D/shards/train --tokenizer $D/spm.model \
    --out runs/bf16 --steps 60 --batch-size 128 --log-every 20 --eval-every 0 --save-every 0 2>&1 |
    grep -E "step +(20|40|60)/|done" | sed "s/^.*info\] /trainer bf16 /"
  $r bert-train --device cpu --precision bf16 --init-from runs/bf16 --qat --calib-batches 2 --train $D/shards/train \
    --tokenizer $D/spm.model --out runs/bf16-qat --steps 60 --batch-size 128 --log-every 20 --eval-every 0 \
    --save-every 0 2>&1 | grep -E "step +(20|40|60)/|done" | sed "s/^.*info\] /trainer bf16 qat /"
  BERT_BF16_PRODUCTS=vdpbf16ps step fp32 --precision bf16 | sed "s/^/vdpbf16ps /"
  BERT_BF16_PRODUCTS=copies step fp32 --precision bf16 | sed "s/^/copies /"
  step fp32 | sed "s/^/fp32 /"
done
