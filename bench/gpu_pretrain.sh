#!/usr/bin/env bash
# Pretraining quality on a GPU: BERT-mini on the demo data for 10k steps (batch 128, TF32), held-out and
# Brown MLM/NSP accuracy, then QAT from it (1k steps) with learned, fixed and LSQ scales, and FP32 vs PTQ vs
# QAT on Brown. Run on the GPU
# machine from the repository root with a bundle (scripts/gpu_bundle.sh) and the demo corpus packed here
# by `tar -C cache -cJf cache-gpu/corpus.tar.xz corpus/{brown.txt,heldout.paragraphs.txt,train.paragraphs.txt,manifest.json}`:
#   bash bench/gpu_pretrain.sh [RESULTS_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-runs/gpu-pretrain}
steps=${STEPS:-10000}
mkdir -p cache "$results"
[ -f cache/corpus/manifest.json ] || tar -C cache -xJf cache-gpu/corpus.tar.xz
OUT=cache BERT_DATA="bash gpu-bundle/run.sh bert-data" bash scripts/demo_data.sh > "$results/data.log" 2>&1
run() { bash gpu-bundle/run.sh "$@"; }
D=cache/data
[ -f runs/mini-gpu/checkpoint.h5 ] && [ "${FRESH:-0}" != 1 ] && echo "runs/mini-gpu exists (FRESH=1 to retrain)" ||
run bert-train --device cuda --precision tf32 --preset mini --train $D/shards/train --eval $D/shards/heldout \
  --tokenizer $D/spm.model --out runs/mini-gpu --steps "$steps" --batch-size 128 --lr 1e-3 --warmup 0.1 \
  --eval-every 2000 --save-every 5000 --log-every 500 2>&1 | tee "$results/train.log" | grep -E "step .*0/|eval|done"
for set in heldout brown; do
  run bert-eval --device cuda --checkpoint runs/mini-gpu --shards $D/shards/$set --mlm-accuracy --nsp-accuracy \
    --json-out "$results/fp32-$set.json" > /dev/null
done
# QAT from it with each way of training the scales (learned, fixed, lsq) and with distillation from the FP32
# model (learned-distill: --distill 0.5), then FP32 vs PTQ vs QAT on Brown (every calibrator for the first,
# percentile only after). VARIANTS picks some (VARIANTS= for none: pretraining only).
calibrators=max,percentile,entropy,mse
for variant in ${VARIANTS-learned fixed lsq learned-distill}; do
  scales=${variant%-distill}
  extra=()
  [ "$variant" = "$scales" ] || extra=(--distill 0.5 --distill-temperature 2)
  run bert-train --device cuda --precision tf32 --init-from runs/mini-gpu/checkpoint.h5 --qat --calibrator percentile \
    --calib-batches 16 --train $D/shards/train --eval $D/shards/heldout --tokenizer $D/spm.model \
    --out runs/mini-gpu-qat-$variant --scales $scales "${extra[@]}" --steps ${QAT_STEPS:-1000} --batch-size 128 \
    --lr 1e-4 --eval-every 0 --log-every 250 2>&1 | tee "$results/qat-$variant.log" | grep -E "step .*0/|eval|done|clipping|saturated"
  run bert-eval --device cuda --checkpoint runs/mini-gpu-qat-$variant --shards $D/shards/brown --compare \
    --calibrators $calibrators --calib-shards $D/shards/train --calib-batches 16 \
    --json-out "$results/compare-brown-$variant.json" | tee "$results/compare-brown-$variant.txt"
  calibrators=percentile
done
