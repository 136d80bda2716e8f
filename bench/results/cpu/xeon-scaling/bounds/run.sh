#!/usr/bin/env bash
# What bounds the two targets still open on the GPU machine's Xeon, in one call, into $OUT:
# - thread scaling: the machine's own (machine-ceiling: FMA chains, a memory triad, SGEMM 2048^3 at 1 and 16
#   threads through train-step-bench's ceiling line) beside our training step's (--scaling-rounds: 1 and 16
#   threads alternating in one process), tiny and mini, batch 32 and 128;
# - INT8 evaluation of tiny with its float MLM decoder: per-op profiles of FP32 and INT8 evaluation at 1 and 16
#   threads, whose float decoder time bounds INT8 / FP32 whatever the encoder costs (Amdahl);
# then every GPU test with this bundle. From the repository root, gpu-bundle.tar.xz carried.
set -uo pipefail
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
export OMP_WAIT_POLICY=passive
lscpu | grep -E "Model name|Thread|Core|Socket|MHz" > "$OUT/lscpu.txt"
OMP_NUM_THREADS=16 bash gpu-bundle/run.sh machine-ceiling --threads 16 --triad-mib 1024 --no-pairs \
  > "$OUT/ceiling.txt" 2>&1
cat "$OUT/ceiling.txt"
OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 32,128 --modes fp32 \
  --steps 3 --warmup 1 --scaling-rounds 3 > "$OUT/rounds.log" 2>&1
grep -v "^ *$" "$OUT/rounds.log" | tail -30
for t in 1 16; do
  OMP_NUM_THREADS=$t bash gpu-bundle/run.sh train-step-bench --presets tiny --batches 64 --modes fp32,int8 \
    --steps 3 --warmup 1 --profile > "$OUT/eval-profile-t$t.log" 2>&1
  grep -E "SGEMM|^tiny|linear_cross_entropy_scores|^total" "$OUT/eval-profile-t$t.log"
done
timeout 300 bash gpu-bundle/run.sh tests > "$OUT/gpu-tests.log" 2>&1
grep -E "PASSED|FAILED|tests ran|Skipped|SKIPPED" "$OUT/gpu-tests.log" | tail -20
