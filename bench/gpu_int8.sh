#!/usr/bin/env bash
# INT8 inference on a GPU: BERT-mini pretrained on the demo data (STEPS BF16 steps), PTQ (percentile, 16
# training batches, --save-calibrated), then `bert-eval --int8 --device cuda` in FP32 and BF16 on the
# held-out and Brown shards (FP32, the fake-quantized model and INT8, timed, with the share of INT8
# predictions equal to the fake-quantized model's), the same for task models fine-tuned from it (Brown genres,
# 600 BF16 steps; part-of-speech tags, 1,000; cache/tasks from scripts/brown_tasks.py, TASKS= leaves them
# out), and `train-step-bench --modes fp32,fp32-fused,qat,int8` for the
# evaluation throughput of BERT-base and mini at batch 128, 32, 8 and 1 (float with the attention products
# unfused and fused, fake-quantized and INT8 in
# the precision given), in BF16 and FP32, beside PyTorch in BF16 (bench/torch_step_bench.py: SDPA and fused
# AdamW, eager and compiled; TORCH=0 leaves it out). Writes RESULTS_DIR/{int8-SET-PRECISION,bench-PRECISION,
# torch-*}.json.
#   bash bench/gpu_int8.sh [RESULTS_DIR]
# Needs an NVIDIA GPU, a bundle (PACK=1 bash scripts/gpu_bundle.sh) and the demo shards in cache/data
# (scripts/demo_data.sh). Environment: STEPS (3000), BIN (a build's tools and bench instead of the bundle),
# AGREEMENT=0 (the throughput alone: no model trained, no agreement measured), PRECISIONS (ours, default
# "bf16 fp32"), COMPILED (PyTorch's runs under torch.compile, default "base-128 base-32 mini-128 base-8
# base-1").
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-runs/gpu-int8}
mkdir -p "$results"
[ -n "${BIN:-}" ] || [ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
run() { if [ -n "${BIN:-}" ]; then "$BIN/$1" "${@:2}"; else bash gpu-bundle/run.sh "$@"; fi; }
D=cache/data
base=runs/mini-int8-gpu
agreement() {
  [ -f $base/checkpoint.h5 ] ||
    run bert-train --device cuda --precision bf16 --preset mini --train $D/shards/train --tokenizer $D/spm.model \
      --out $base --steps "${STEPS:-3000}" --batch-size 128 --lr 1e-3 --warmup 0.1 --log-every 1000 --save-every 0 \
      --eval-every 0 2>&1 | grep -E "done"
  mkdir -p $base-ptq
  run bert-eval --device cuda --checkpoint $base --shards $D/shards/heldout --max-batches 1 \
    --save-calibrated $base-ptq/checkpoint.h5 --calibrator percentile --calib-shards $D/shards/train \
    --calib-batches 16 > /dev/null
  for set in heldout brown; do
    for precision in fp32 bf16; do
      echo "== $set, $precision"
      run bert-eval --device cuda --precision $precision --checkpoint $base-ptq --shards $D/shards/$set --int8 \
        --json-out "$results/int8-$set-$precision.json" | tail -5
    done
  done
  for task in ${TASKS-genre pos}; do
    kind=token-cls steps=1000
    [ "$task" = genre ] && kind=seq-cls steps=600
    shards=cache/tasks/shards-$task
    mkdir -p $shards runs/$task-int8-gpu-ptq
    for split in train test; do
      [ -f $shards/$split.hdf5 ] || run bert-data task --task $kind --input cache/tasks/brown-$task/$split.jsonl \
        --tokenizer $D/spm.model --labels cache/tasks/brown-$task/labels.txt --max-seq-len 128 \
        --output $shards/$split.hdf5 > /dev/null
    done
    run bert-train --device cuda --precision bf16 --train $shards/train.hdf5 --init-from $base \
      --out runs/$task-int8-gpu --steps $steps --batch-size 32 --lr 1e-4 --warmup 0.1 --eval-every 0 --save-every 0 \
      2>&1 | grep -E "done"
    run bert-eval --device cuda --checkpoint runs/$task-int8-gpu --shards $shards/test.hdf5 --max-batches 1 \
      --save-calibrated runs/$task-int8-gpu-ptq/checkpoint.h5 --calibrator percentile \
      --calib-shards $shards/train.hdf5 --calib-batches 16 > /dev/null
    for precision in fp32 bf16; do
      echo "== $task, $precision"
      run bert-eval --device cuda --precision $precision --checkpoint runs/$task-int8-gpu-ptq \
        --shards $shards/test.hdf5 --int8 --json-out "$results/int8-$task-$precision.json" | tail -5
    done
  done
}
[ "${AGREEMENT:-1}" = 0 ] || agreement
for precision in ${PRECISIONS:-bf16 fp32}; do
  run train-step-bench --device cuda --precision $precision --presets base,mini --batches 128,32,8,1 --seq 128 \
    --vocab 30522 --steps 20 --warmup 3 --warmup-seconds 1 --modes fp32,fp32-fused,qat,int8 \
    --json "$results/bench-$precision.json" | grep -E "^(device|mini|base) "
done
[ "${TORCH:-1}" = 1 ] || exit 0
torch=(python3 bench/torch_step_bench.py --device cuda --dtype bf16 --seq 128 --vocab 30522 --steps 20 --warmup 3
  --warmup-seconds 1 --attention sdpa --adamw fused)
"${torch[@]}" --presets base,mini --batches 128,32,8,1 > "$results/torch-sdpa.json"
for config in ${COMPILED:-base-128 base-32 mini-128 base-8 base-1}; do
  set -- ${config/-/ }
  "${torch[@]}" --presets "$1" --batches "$2" --compile > "$results/torch-compiled-$1-$2.json"
done
grep -h eval_seq_per_s "$results"/torch-*.json
