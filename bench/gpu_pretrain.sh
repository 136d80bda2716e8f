#!/usr/bin/env bash
# Pretraining quality on a GPU: BERT-mini on the demo data for 10k steps (batch 128, TF32), held-out and
# Brown MLM/NSP accuracy, then QAT from it (1k steps) with learned, fixed and LSQ scales, and FP32 vs PTQ vs
# QAT on Brown. Run on a host with an NVIDIA GPU, from the repository root, with a bundle (scripts/gpu_bundle.sh) and the demo corpus packed here
# by `tar -C cache -cJf cache-gpu/corpus.tar.xz corpus/{brown.txt,heldout.paragraphs.txt,train.paragraphs.txt,manifest.json}`:
#   bash bench/gpu_pretrain.sh [RESULTS_DIR]
# Environment: PRESET (mini; base: BERT-base), PRECISION (tf32; bf16 for BF16 mixed precision), runs go to
# runs/mini-gpu (mini, tf32) or runs/PRESET-gpu-PRECISION; STEPS (pretraining, 10000), BATCH (128), LR (1e-3),
# QAT_STEPS (1000), VARIANTS (below), EVAL_SETS ("brown"; e.g.
# "heldout brown"), ORT_BATCHES (unset: no ONNX Runtime scoring). The reference run:
#   STEPS=6000 VARIANTS="fp32 learned fixed learned-distill fixed-distill" EVAL_SETS="heldout brown" \
#   ORT_BATCHES=50 bash bench/gpu_pretrain.sh RESULTS_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-runs/gpu-pretrain}
steps=${STEPS:-10000}
precision=${PRECISION:-tf32}
preset=${PRESET:-mini}
base=runs/mini-gpu
[ "$preset-$precision" = mini-tf32 ] || base=runs/$preset-gpu-$precision
mkdir -p cache "$results"
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz  # the packed bundle (PACK=1 bash scripts/gpu_bundle.sh)
[ -f cache/corpus/manifest.json ] || tar -C cache -xJf cache-gpu/corpus.tar.xz
OUT=cache BERT_DATA="bash gpu-bundle/run.sh bert-data" bash scripts/demo_data.sh > "$results/data.log" 2>&1
run() { bash gpu-bundle/run.sh "$@"; }
D=cache/data
[ -f $base/checkpoint.h5 ] && [ "${FRESH:-0}" != 1 ] && echo "$base exists (FRESH=1 to retrain)" ||
run bert-train --device cuda --precision $precision --preset $preset --train $D/shards/train --eval $D/shards/heldout \
  --tokenizer $D/spm.model --out $base --steps "$steps" --batch-size ${BATCH:-128} --lr ${LR:-1e-3} --warmup 0.1 \
  --eval-every 2000 --save-every 5000 --log-every 500 2>&1 | tee "$results/train.log" | grep -E "step .*0/|eval|done"
for set in heldout brown; do
  run bert-eval --device cuda --checkpoint $base --shards $D/shards/$set --mlm-accuracy --nsp-accuracy \
    --json-out "$results/fp32-$set.json" > /dev/null
done
# QAT from it with each way of training the scales (learned, fixed, lsq), with distillation from the FP32
# model (*-distill: --distill 0.5), and FP32 trained on for as long (fp32: the baseline QAT is held to), then
# FP32 vs PTQ vs QAT on held-out text and on Brown (every calibrator for the first, percentile only after),
# and each QAT model's Q/DQ export (--masked-positions) scored in ONNX Runtime beside the engine on the first
# ORT_BATCHES batches of 64. VARIANTS picks some (VARIANTS= for none: pretraining only).
calibrators=max,percentile,entropy,mse
ort_script=scripts/ort_run.js
command -v node > /dev/null || ort_script=scripts/ort_run.py  # Python's onnxruntime where Node is missing
for variant in ${VARIANTS-learned fixed lsq learned-distill}; do
  scales=${variant%-distill}
  extra=()
  [ "$variant" = "$scales" ] || extra=(--distill 0.5 --distill-temperature 2)
  if [ "$variant" = fp32 ]; then
    extra=()
  else
    extra+=(--qat --calibrator percentile --calib-batches 16 --scales $scales)
  fi
  run bert-train --device cuda --precision $precision --init-from $base/checkpoint.h5 \
    --train $D/shards/train --eval $D/shards/heldout --tokenizer $D/spm.model \
    --out $base-qat-$variant "${extra[@]}" --steps ${QAT_STEPS:-1000} --batch-size 128 \
    --lr 1e-4 --eval-every 0 --log-every 250 2>&1 | tee "$results/qat-$variant.log" | grep -E "step .*0/|eval|done|clipping|saturated"
  for set in ${EVAL_SETS:-brown}; do
    run bert-eval --device cuda --checkpoint $base-qat-$variant --shards $D/shards/$set --compare \
      --calibrators $calibrators --calib-shards $D/shards/train --calib-batches 16 \
      --json-out "$results/compare-$set-$variant.json" | tee "$results/compare-$set-$variant.txt"
    if [ "$variant" != fp32 ] && [ -n "${ORT_BATCHES:-}" ]; then
      [ -f $base-qat-$variant/mlm.onnx ] ||
        run bert-export --checkpoint $base-qat-$variant --onnx $base-qat-$variant/mlm.onnx --qdq \
          --masked-positions 2>&1 | tail -1
      run bert-eval --device cuda --checkpoint $base-qat-$variant --shards $D/shards/$set --batch-size 64 \
        --max-batches $ORT_BATCHES --onnx $base-qat-$variant/mlm.onnx --ort-script $ort_script \
        --json-out "$results/onnx-$set-$variant.json" | grep -E "MLM accuracy|ONNX Runtime" | tee "$results/onnx-$set-$variant.txt"
    fi
  done
  calibrators=percentile
done
tar -C "$(dirname "$results")" -czf "$results.tar.gz" "$(basename "$results")"  # one file to fetch
