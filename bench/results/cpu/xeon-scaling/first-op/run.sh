#!/usr/bin/env bash
# Why the first op of a step or batch (zeroing the gradients, the embedding gather) is slower on 16 threads
# than on one on the Xeon: per-op profiles of tiny b64 (FP32 training and evaluation, INT8 evaluation) at 16
# threads waiting passively (the default: idle threads sleep at once) against spinning 10^5 iterations first
# (GOMP_SPINCOUNT), two rounds alternating. If waking sleeping vCPUs is the cost, spinning removes it.
# From the repository root, gpu-bundle.tar.xz carried; into $OUT.
set -uo pipefail
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
for round in 1 2; do
  for policy in passive spin; do
    if [ $policy = passive ]; then env=(OMP_WAIT_POLICY=passive); else env=(GOMP_SPINCOUNT=100000); fi
    env "${env[@]}" OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets tiny --batches 64 \
      --modes fp32,int8 --steps 5 --warmup 2 --profile > "$OUT/$policy-$round.log" 2>&1
    echo "== $policy round $round"
    grep -E "^tiny|^gather_rows|^\(zero gradients\)|^total|^add_layer_norm|^permute" "$OUT/$policy-$round.log"
  done
done
