#!/usr/bin/env bash
# Builds the GPU-capable programs and tests here (CUDA + a CPU target any x86-64-v3 machine runs) and
# gathers them with the shared libraries they need into one folder, for a machine with an NVIDIA GPU that lacks the
# build's Debian packages:
#   bash scripts/gpu_bundle.sh [OUT]          # default OUT: gpu-bundle/ (bin/, lib/, run.sh)
#   PACK=1 bash scripts/gpu_bundle.sh         # also OUT.tar.xz (about 30 MB instead of 350: carry that, and
#                                             # unpack it there with `tar -xJf gpu-bundle.tar.xz`)
# On the machine with the GPU, from a copy of the repository root:
#   bash gpu-bundle/run.sh tests               # every GPU test (ops vs CPU, golden model, training)
#   bash gpu-bundle/run.sh bert-train --help   # any bundled program
# The CUDA driver and cuBLAS are expected on the machine with the GPU (they are not bundled).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-bundle}
# The machine's processors: nproc alone obeys OMP_NUM_THREADS, which the test suite sets to 1 for its
# processes (a build under it ran one compile at a time).
jobs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)
build=build-gpu
mkdir -p "$build"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DBERT_ARCH=avx2 -DBERT_CUDA=ON > "$build/configure.log" 2>&1 ||
  { tail -20 "$build/configure.log"; exit 1; }
programs=(bert-train bert-eval bert-data bert-export train-step-bench gemm-bench machine-ceiling)
tests=(cuda_tests core_tests model_tests train_tests)
cmake --build "$build" -j "$jobs" --target "${programs[@]}" "${tests[@]}" > "$build/build.log" 2>&1 ||
  { grep -E "error|Error" -A3 "$build/build.log" | head -40; exit 1; }

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for p in "${programs[@]}"; do cp "$build/tools/$p" "$out/bin/" 2>/dev/null || cp "$build/bench/$p" "$out/bin/"; done
for t in "${tests[@]}"; do cp "$build/tests/$t" "$out/bin/"; done
# Every non-glibc shared library the binaries load, except the GPU driver's and cuBLAS (the host's
# own must match its driver).
for f in "$out"/bin/*; do
  ldd "$f" | awk '/=> \//{print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libcuda.so*|libcublas*|libresolv.so*) ;;
    *) cp -L "$lib" "$out/lib/" ;;
  esac
done
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs a bundled program, or `tests` for every bundled GPU test, with the bundled libraries.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export BERT_TEST_FIXTURES="${BERT_TEST_FIXTURES:-$here/../tests/fixtures}"
if [ "${1:-}" = tests ]; then
  # Every test program that holds GPU tests (their CPU tests run too), then one verdict over all of them.
  shift
  status=0 passed=0 failed=0 skipped=0 crashed=""
  for t in cuda_tests core_tests model_tests train_tests; do
    log=$(mktemp)
    code=0
    "$here/bin/$t" --gtest_brief=1 "$@" 2>&1 | tee "$log" || code=$?
    # Passed and skipped from gtest's closing lines ("[  PASSED  ] N tests.", "[  SKIPPED ] N tests, ...");
    # failed as the distinct tests named on "[  FAILED  ] Suite.Test" lines (brief output has no count).
    read -r p k < <(awk '/^\[  PASSED  \] [0-9]+ test/ {p += $4} /^\[  SKIPPED \] [0-9]+ test/ {k += $4}
                        END {print p + 0, k + 0}' "$log")
    f=$( (grep -oE '^\[  FAILED  \] [A-Za-z0-9_/]+\.[A-Za-z0-9_/]+' "$log" || true) | sort -u | wc -l)
    passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + k))
    # A program that stopped without naming a failed test (a crash, an abort) fails the run too.
    if [ "$code" -ne 0 ]; then status=1; [ "$f" -gt 0 ] || crashed="$crashed $t"; fi
    rm -f "$log"
  done
  echo "GPU test programs (${GPU_NAME:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)}): $passed passed, $failed failed, $skipped skipped${crashed:+; stopped without a verdict:$crashed}"
  [ "$failed" -eq 0 ] || status=1
  exit $status
fi
program=$1
shift
exec "$here/bin/$program" "$@"
RUN
chmod +x "$out/run.sh"
echo "[gpu-bundle] $(du -sh "$out" | cut -f1) in $out (programs: ${programs[*]}; tests: ${tests[*]})"
if [ "${PACK:-0}" = 1 ]; then
  # One stream with a window wider than the bundle: each program carries the same CUDA kernels (tens of MB),
  # which then pack once (threaded xz splits the stream into blocks that each hold them again: 130 MB).
  tar -C "$(dirname "$out")" -cf - "$(basename "$out")" | xz -T1 --lzma2=preset=6,dict=384MiB > "$out.tar.xz.partial" && mv "$out.tar.xz.partial" "$out.tar.xz"
  echo "[gpu-bundle] packed: $(du -sh "$out.tar.xz" | cut -f1) in $out.tar.xz"
fi
