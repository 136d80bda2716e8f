#!/usr/bin/env bash
# The Xeon after integer self-attention became one op per (sequence, head) and LayerNorm's row sums
# vector reductions: INT8 evaluation against FP32 (tiny, mini batch 64; base batch 32 with BERT's
# vocabulary) at 16 threads; ours against PyTorch 2.11 at 16 threads; scaling in alternating rounds; the
# per-op profile of mini batch 32 at 16 threads and at 1; the GPU tests. Repository root, $OUT set.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
B="bash gpu-bundle/run.sh train-step-bench"
OMP_NUM_THREADS=16 $B --presets tiny,mini --batches 64 --modes fp32,int8,int8-decoder --steps 5 --warmup 2 \
  > $OUT/int8-t16.log 2>&1; grep -E "^(tiny|mini) " $OUT/int8-t16.log
OMP_NUM_THREADS=16 $B --presets base --batches 32 --vocab 30522 --modes fp32,int8,int8-decoder --steps 3 --warmup 1 \
  > $OUT/int8-base-t16.log 2>&1; grep -E "^base " $OUT/int8-base-t16.log
OMP_NUM_THREADS=16 $B --presets tiny,mini --batches 32,128 --modes fp32,qat --steps 5 --warmup 2 \
  > $OUT/ours-t16.log 2>&1; tail -9 $OUT/ours-t16.log
python3 bench/torch_step_bench.py --presets tiny,mini --batches 32,128 --steps 5 --warmup 2 --threads 16 \
  --flush-denormals > $OUT/torch-t16.txt 2>&1; cut -c1-160 $OUT/torch-t16.txt
OMP_NUM_THREADS=16 $B --presets tiny,mini --batches 128,32 --modes fp32 --steps 3 --warmup 2 --scaling-rounds 3 \
  --json $OUT/rounds.json > $OUT/rounds.log 2>&1; grep -E "^(tiny|mini) |scaling" $OUT/rounds.log
for t in 16 1; do
  OMP_NUM_THREADS=$t $B --presets mini --batches 32 --modes fp32 --steps 3 --warmup 1 --profile \
    > $OUT/profile-mini-b32-t$t.log 2>&1
done
grep -A20 "training step" $OUT/profile-mini-b32-t16.log | head -22
bash gpu-bundle/run.sh tests > $OUT/gpu-tests.log 2>&1; grep -E "PASSED|FAILED|SKIPPED|tests ran" $OUT/gpu-tests.log
