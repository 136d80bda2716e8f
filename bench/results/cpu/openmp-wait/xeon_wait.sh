#!/usr/bin/env bash
# OpenMP wait policy on the Xeon: 16 threads alone, and with 4 busy processes; train step and eval.
# The logs beside this script were taken before the programs chose passive waiting themselves: their
# "X=default" rows are libgomp's default, which GOMP_SPINCOUNT=300000 (used here now) reproduces.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
B="bash gpu-bundle/run.sh train-step-bench"
lscpu | grep -E "Model name|^CPU\(s\)"
run() { OMP_NUM_THREADS=16 env "$@" $B --presets tiny,mini --batches 32,128 --modes fp32 --steps 5 --warmup 2 2>&1 | grep -E "^(tiny|mini) " ; }
for rep in 1 2; do
for policy in GOMP_SPINCOUNT=300000 OMP_WAIT_POLICY=passive; do
  echo "== $policy alone (rep $rep)"; run $policy
  pids=(); for i in 1 2 3 4; do python3 -c 'while True: pass' & pids+=($!); done
  echo "== $policy with 4 busy processes (rep $rep)"; run $policy
  kill ${pids[@]}; wait 2>/dev/null
done
done
