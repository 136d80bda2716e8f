#!/usr/bin/env bash
# The test programs on an AVX2-only CPU, on any x86-64 machine: every GoogleTest program of an x86-64-v3
# build runs under QEMU's user-mode emulator presenting an AMD EPYC-Rome (AVX2 and FMA, no AVX-512, no
# VNNI), and so does Node.js when a test runs an export in ONNX Runtime. Whatever is chosen by CPUID at run
# time, on our side (GEMM, vector and integer kernels, the tests' own branches) and on ONNX Runtime's (its
# MLAS kernels), takes the AVX2 path, as on a real AVX2-only machine (GemmKernels.AutoPicksTheBestKernelThisCpuRuns
# checks that the automatic choice there is the build's AVX2 set). The programs a test starts (bert-train,
# bert-eval, ...) run natively, on this machine's kernels.
# Emulation runs the tests 5-20x slower than the machine: this is a check to run by hand, not part of
# scripts/test.sh.
#   bash scripts/test_avx2_cpu.sh [BUILD_DIR]     # default build-avx2 (x86-64-v3, no CUDA), configured if absent
# Environment: CPU_MODEL (EPYC-Rome; `qemu-x86_64 -cpu help` lists others), FILTER (a gtest filter; by default
# all but two RunProgram cases: glibc's posix_spawnp learns of a failed exec through a vfork-style clone that
# the emulator runs as a plain fork, so "no such program" is not reported under it, on any CPU).
# Results: BUILD_DIR/emulated/NAME.log per program; the summary line counts passed and failed programs.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-avx2}
cpu=${CPU_MODEL:-EPYC-Rome}
# The machine's processors: nproc alone obeys OMP_NUM_THREADS, which the test suite sets to 1 for its
# processes (a build under it ran one compile at a time).
jobs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)
bash scripts/setup.sh qemu-user > /dev/null
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DBERT_ARCH=avx2 -DBERT_CUDA=OFF -DBERT_BUILD_BENCH=OFF > /dev/null
fi
# Brought up to date every time, so the programs tested are the checkout's.
cmake --build "$build" -j "$jobs" > "$build/build.log" 2>&1 || { tail -30 "$build/build.log"; exit 1; }
node_path=$(command -v node) || { echo "[avx2-cpu] error: node not found (scripts/setup.sh installs it)" >&2; exit 1; }
wrap=$(mktemp -d)
trap 'rm -rf "$wrap"' EXIT
# The tests run ONNX Runtime as `node scripts/ort_run.js ...`, found on PATH.
printf '#!/bin/sh\nexec qemu-x86_64 -cpu %s %s "$@"\n' "$cpu" "$node_path" > "$wrap/node"
chmod +x "$wrap/node"
mkdir -p "$build/emulated"
programs=$(find "$build/tests" -maxdepth 1 -name '*_tests' -type f -perm -u+x | sort)
echo "[avx2-cpu] $(echo "$programs" | wc -w) test programs under qemu-x86_64 -cpu $cpu, $jobs at a time"
unset BERT_CPU_KERNELS
export PATH="$wrap:$PATH" OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive cpu build
export GTEST_FILTER=${FILTER:-*-RunProgram.PathsWithQuotesSpacesAndDollarsPassIntact:RunProgram.StreamsBinaryOutputWhileTheProgramRunsAndStopsItWhenTheReaderFails}
start=$(date +%s)
echo "$programs" | xargs -P "$jobs" -I{} sh -c '
  name=$(basename {})
  if qemu-x86_64 -cpu "$cpu" {} --gtest_brief=1 > "$build/emulated/$name.log" 2>&1; then r=passed; else r=FAILED; fi
  echo "[avx2-cpu] $name $r: $(grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$build/emulated/$name.log" | tr "\n" " ")"
  [ $r = passed ]' && status=0 || status=1
passed=0 failed=0
for p in $programs; do
  if grep -q '^\[  PASSED  \]' "$build/emulated/$(basename "$p").log" &&
     ! grep -q '^\[  FAILED  \]' "$build/emulated/$(basename "$p").log"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
done
echo "[avx2-cpu] $(( $(date +%s) - start )) s"
echo "$passed passed, $failed failed"
exit $status
