#!/usr/bin/env bash
# Scaling on the Xeon after the parallel broadcast and embedding backward, and how OpenMP's wait policy
# moves it: FP32 batch 128, tiny and mini, 1 thread, then 16 threads under passive waiting (the programs'
# default) and under short and long spinning (GOMP_SPINCOUNT), alone and beside 4 busy processes. Into $OUT.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
B="bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 --steps 5 --warmup 2"
run() { local name=$1; shift; env "$@" $B > $OUT/$name.log 2>&1; echo "== $name: $*"; grep -E "^(tiny|mini) " $OUT/$name.log; }
run t1 OMP_NUM_THREADS=1
for rep in 1 2; do
  for policy in OMP_WAIT_POLICY=passive GOMP_SPINCOUNT=10000 GOMP_SPINCOUNT=100000 GOMP_SPINCOUNT=300000; do
    run t16-${policy#*=}-rep$rep OMP_NUM_THREADS=16 $policy
  done
done
pids=(); for i in 1 2 3 4; do python3 -c 'while True: pass' & pids+=($!); done
for policy in OMP_WAIT_POLICY=passive GOMP_SPINCOUNT=10000 GOMP_SPINCOUNT=100000; do
  run loaded-t16-${policy#*=} OMP_NUM_THREADS=16 $policy
done
kill ${pids[@]}; wait 2>/dev/null
