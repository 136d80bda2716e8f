#!/usr/bin/env bash
# The GPU machine's Xeon in one call, from the repository root with $OUT set (gpu-bundle.tar.xz from
# scripts/gpu_bundle.sh and cache/xeon carried: one demo training shard and its tokenizer):
# 1. BF16 products on each kernel (BERT_BF16_PRODUCTS=amx, vdpbf16ps, copies): gemm-bench's BF16 table and
#    the BF16 training step (tiny, batch 128), at 16 threads; what an Intel CPU without usable AMX gets.
# 2. bert-train --precision bf16 against train-step-bench --precision bf16 (tiny, batch 128; FP32 master
#    weights, then QAT).
# 3. INT8 evaluation with the MLM decoder's logits against without them (train-step-bench --eval-outputs).
# 4. Every GPU test.
set -uo pipefail
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
r="bash gpu-bundle/run.sh"
export OMP_NUM_THREADS=16 OMP_WAIT_POLICY=passive
for p in amx vdpbf16ps copies; do
  BERT_BF16_PRODUCTS=$p $r gemm-bench --reps 3 > "$OUT/gemm-$p.log" 2>&1
  sed -n '/BF16 operands/,/^$/p' "$OUT/gemm-$p.log" | sed "s/^/$p /"
  BERT_BF16_PRODUCTS=$p $r train-step-bench --presets tiny --batches 128 --modes fp32 --precision bf16 --steps 5 \
    --warmup 2 > "$OUT/step-$p.log" 2>&1
  grep -E "^tiny" "$OUT/step-$p.log" | sed "s/^/$p /"
done
$r train-step-bench --presets tiny --batches 128 --modes fp32 --steps 5 --warmup 2 > "$OUT/step-fp32.log" 2>&1
grep -E "^tiny|threads" "$OUT/step-fp32.log" | sed "s/^/fp32 /"

D=cache/xeon
$r train-step-bench --presets tiny --batches 128 --modes fp32,qat --precision bf16 --steps 10 --warmup 2 \
  > "$OUT/bench-bf16.log" 2>&1
grep -E "^tiny" "$OUT/bench-bf16.log" | sed "s/^/bench /"
rm -rf runs/bf16 runs/bf16-qat
$r bert-train --device cpu --precision bf16 --preset tiny --train $D/shards/train --tokenizer $D/spm.model \
  --out runs/bf16 --steps 60 --batch-size 128 --log-every 20 --eval-every 0 --save-every 0 > "$OUT/train-bf16.log" 2>&1
grep -E "on the CPU|step +(20|40|60)/|done" "$OUT/train-bf16.log"
$r bert-train --device cpu --precision bf16 --init-from runs/bf16 --qat --calib-batches 2 --train $D/shards/train \
  --tokenizer $D/spm.model --out runs/bf16-qat --steps 60 --batch-size 128 --log-every 20 --eval-every 0 \
  --save-every 0 > "$OUT/train-bf16-qat.log" 2>&1
grep -E "step +(20|40|60)/|done" "$OUT/train-bf16-qat.log"

for outputs in logits scores; do
  $r train-step-bench --presets tiny,mini --batches 64 --modes fp32,int8,int8-decoder --steps 5 --warmup 2 \
    --eval-outputs $outputs > "$OUT/int8-$outputs.log" 2>&1
  grep -E "^tiny|^mini" "$OUT/int8-$outputs.log" | sed "s/^/$outputs /"
done

left=$(( 570 - SECONDS ))  # what a 600 s call leaves
echo "measurements took $SECONDS s; the GPU tests get $left s"
timeout $left $r tests > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests: exit $?"
grep -E "PASSED|FAILED|SKIPPED" "$OUT/gpu-tests.log" | head -20
