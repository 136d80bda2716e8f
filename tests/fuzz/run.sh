#!/usr/bin/env bash
# Fuzzes every target (or those named) with libFuzzer for SECONDS each, two at a time, from the
# committed seed corpus. Builds build-fuzz/ with clang, ASan+UBSan and -DBERT_FUZZ=ON first.
# Findings (crash-*, leak-*, timeout-*) land in build-fuzz/findings/<target>/ (or $FUZZ_FINDINGS); copy each into
# tests/fuzz/corpus/<target>/ once fixed, so CTest replays it forever after.
# Usage: bash tests/fuzz/run.sh SECONDS [target...]     e.g. bash tests/fuzz/run.sh 600
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS_EACH=${1:?usage: run.sh SECONDS [target...]}
shift
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(json safetensors shard checkpoint text vocab task)
B=build-fuzz
F=${FUZZ_FINDINGS:-$B/findings}  # where crash/leak/timeout inputs and logs go
CC=clang CXX=clang++ cmake -S . -B $B -DBERT_FUZZ=ON -DBERT_SANITIZE=address,undefined -DBERT_CUDA=OFF -DBERT_BUILD_BENCH=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
cmake --build $B -j2 --target $(printf 'fuzz_%s ' "${TARGETS[@]}") > $B/fuzz-build.log 2>&1 || { tail -20 $B/fuzz-build.log; exit 1; }
fuzz_one() {
  local t=$1
  mkdir -p $B/corpus/$t $F/$t
  cp -n tests/fuzz/corpus/$t/* $B/corpus/$t/ 2>/dev/null || true
  # One thread each: two targets share the two cores. Leak checks stay on (ASan's default).
  # allocator_may_return_null: a corrupt HDF5 file makes libhdf5 try a huge malloc (inside H5C_protect);
  # real malloc returns NULL and HDF5 fails cleanly, which is what we want to test, not ASan's report.
  # Fork mode keeps fuzzing after a finding (libhdf5 has memory bugs of its own on corrupt files, see
  # tests/fuzz/README.md), so every target runs the whole time and all findings are collected.
  ASAN_OPTIONS=allocator_may_return_null=1 LSAN_OPTIONS=suppressions=$PWD/tests/fuzz/lsan.supp OMP_NUM_THREADS=1 \
    $B/tests/fuzz/fuzz_$t $B/corpus/$t -max_total_time=$SECONDS_EACH -rss_limit_mb=4096 -timeout=20 \
    -fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 \
    -artifact_prefix=$F/$t/ > $F/$t.log 2>&1 || true
  local execs=$(grep -oE 'exec/s: [0-9]+' $F/$t.log | tail -1 | grep -oE '[0-9]+$' || echo "?")
  local total=$(grep -oE '^#[0-9]+' $F/$t.log | tail -1 | tr -d '#' || echo "?")
  local found=$(ls $F/$t | wc -l)
  echo "fuzz_$t: ${SECONDS_EACH}s, $total executions ($execs/s at the end), corpus $(ls $B/corpus/$t | wc -l) inputs, $found finding(s)"
}
running=0
for t in "${TARGETS[@]}"; do
  fuzz_one $t &
  running=$((running + 1))
  if [ $running -ge 2 ]; then wait -n; running=$((running - 1)); fi
done
wait
