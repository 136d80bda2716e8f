#!/usr/bin/env bash
# The Xeon with the residual adds inside LayerNorm's pass: the machine's ceilings first (to tell a slow
# period), FP32 training scaling 1 <-> 16 threads in alternating rounds, ours against PyTorch 2.11 at 16
# threads, INT8 evaluation against FP32 at 16 threads, the GPU tests. Repository root, $OUT set.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
R="bash gpu-bundle/run.sh"
$R machine-ceiling --threads 16 --fma-seconds 0.3 --no-pairs > $OUT/ceiling.log 2>&1; grep -A6 "^FMA" $OUT/ceiling.log
OMP_NUM_THREADS=16 $R train-step-bench --presets tiny,mini --batches 128,32 --modes fp32 --steps 3 --warmup 2 \
  --scaling-rounds 3 --json $OUT/rounds.json > $OUT/rounds.log 2>&1; grep -E "^(tiny|mini) |scaling" $OUT/rounds.log
OMP_NUM_THREADS=16 $R train-step-bench --presets tiny,mini --batches 32,128 --modes fp32 --steps 5 --warmup 2 \
  > $OUT/ours-t16.log 2>&1; grep -E "^(tiny|mini) " $OUT/ours-t16.log
python3 bench/torch_step_bench.py --presets tiny,mini --batches 32,128 --steps 5 --warmup 2 --threads 16 \
  --flush-denormals > $OUT/torch-t16.json 2>$OUT/torch-t16.err
python3 -c "
import json,sys
for l in open('$OUT/torch-t16.json'):
    if l.startswith('{'): d=json.loads(l); print('torch', d['preset'], d['batch'], round(d['seq_per_s'],1))"
OMP_NUM_THREADS=16 $R train-step-bench --presets tiny,mini --batches 64 --modes fp32,int8,int8-decoder --steps 5 \
  --warmup 2 > $OUT/int8-t16.log 2>&1; grep -E "^(tiny|mini) " $OUT/int8-t16.log
$R tests > $OUT/gpu-tests.log 2>&1; grep -E "PASSED|FAILED|tests ran" $OUT/gpu-tests.log
