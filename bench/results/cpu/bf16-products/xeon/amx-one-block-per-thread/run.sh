#!/usr/bin/env bash
# AMX BF16 products with one block of C per thread (each block converts and packs its slices of A and B, which
# on BERT's short inner dimensions costs more than the tiles) against four per thread (the bundle before),
# on the GPU machine's Xeon at 16 threads: the GEMM, op and BF16 tests with the new bundle, then two rounds
# alternating the bundles: gemm-bench's BF16 table and the BF16 training step (tiny and mini, batch 128).
# From the repository root with $OUT set; carried: gpu-bundle.tar.xz (after), cache/before/gpu-bundle.tar.xz.
set -uo pipefail
mkdir -p after before
tar -C after -xJf gpu-bundle.tar.xz
tar -C before -xJf cache/before/gpu-bundle.tar.xz
export OMP_WAIT_POLICY=passive
bash after/gpu-bundle/run.sh core_tests --gtest_brief=1 --gtest_filter='*Gemm*:Bf16*:LinearScores*' > "$OUT/tests.log" 2>&1
echo "tests: exit $?"; grep -E "PASSED|FAILED" "$OUT/tests.log"
export OMP_NUM_THREADS=16
for round in 1 2; do
  for which in before after; do
    bash $which/gpu-bundle/run.sh gemm-bench --reps 5 > "$OUT/gemm-$which-$round.log" 2>&1
    sed -n '/BF16 operands/,/^$/p' "$OUT/gemm-$which-$round.log" | sed "s/^/$round $which /"
    bash $which/gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 --precision bf16 \
      --steps 5 --warmup 2 2>&1 | grep -E "^tiny|^mini" | sed "s/^/$round $which /"
  done
done
