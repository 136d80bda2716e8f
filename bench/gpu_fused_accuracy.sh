#!/usr/bin/env bash
# Whether the fused attention trains as well as the unfused one: BERT-mini pretrained twice in BF16 on the demo
# data, 10,000 steps each (batch 128, lr 1e-3, 10% warm-up, seed 1: the same initial weights, batches and
# dropout draws), with `bert-train --attention fused` and `--attention unfused`; then each model's held-out and
# Brown MLM and NSP accuracy. Run on a host with an NVIDIA GPU, from the repository root, with a bundle
# (scripts/gpu_bundle.sh) and the demo corpus packed as for bench/gpu_pretrain.sh:
#   bash bench/gpu_fused_accuracy.sh [RESULTS_DIR]
# Environment: STEPS (10000), BATCH (128), PRESET (mini), SEED (1). Runs go to runs/PRESET-attention-{fused,unfused}
# (with -seedN after it when SEED is not 1).
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-runs/gpu-fused-accuracy}
preset=${PRESET:-mini}
seed=${SEED:-1}
suffix=""
[ "$seed" = 1 ] || suffix=-seed$seed
mkdir -p cache "$results"
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz  # the packed bundle (PACK=1 bash scripts/gpu_bundle.sh)
[ -f cache/corpus/manifest.json ] || tar -C cache -xJf cache-gpu/corpus.tar.xz
DUPE=2 OUT=cache BERT_DATA="bash gpu-bundle/run.sh bert-data" bash scripts/demo_data.sh > "$results/data.log" 2>&1
run() { bash gpu-bundle/run.sh "$@"; }
D=cache/data
for attention in fused unfused; do
  out=runs/$preset-attention-$attention$suffix
  run bert-train --device cuda --precision bf16 --preset "$preset" --train $D/shards/train --tokenizer $D/spm.model \
    --out "$out" --steps "${STEPS:-10000}" --batch-size "${BATCH:-128}" --lr 1e-3 --warmup 0.1 --seed "$seed" \
    --attention $attention --log-every 1000 --save-every 0 --eval-every 0 2>&1 |
    tee "$results/train-$attention$suffix.log" | grep -E "step .*000/|done"
  for set in heldout brown; do
    run bert-eval --device cuda --precision bf16 --checkpoint "$out" --shards $D/shards/$set --mlm-accuracy \
      --nsp-accuracy --json-out "$results/eval-$attention$suffix-$set.json" | grep -E "accuracy|loss"
  done
done
