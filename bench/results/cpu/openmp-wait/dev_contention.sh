#!/usr/bin/env bash
# OpenMP wait policy vs. another busy process, 2 threads, tiny b128 and mini b32 FP32 steps.
# The logs beside this script were taken before the programs chose passive waiting themselves: their
# "X=default" rows are libgomp's default, which GOMP_SPINCOUNT=300000 (used here now) reproduces.
B=${B:-build/bench/train-step-bench}
run() { OMP_NUM_THREADS=2 env "$@" $B --presets tiny,mini --batches 128,32 --modes fp32 --steps 8 --warmup 2 2>&1 | grep -E "^(tiny|mini) " ; }
for rep in 1 2; do
for policy in "GOMP_SPINCOUNT=300000" "OMP_WAIT_POLICY=passive" "GOMP_SPINCOUNT=10000" "OMP_WAIT_POLICY=active"; do
  echo "== $policy alone (rep $rep)"; run $policy
  python3 -c 'while True: pass' & burner=$!
  echo "== $policy with one busy process"; run $policy
  kill $burner; wait $burner 2>/dev/null
done
done
