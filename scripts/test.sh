#!/usr/bin/env bash
# The test suite: set-up, build, every test through CTest (which reports the count). CI runs this.
#   bash scripts/test.sh                      # ./build (Release, native, CUDA code when nvcc is present)
#   BERT_SANITIZERS=1 bash scripts/test.sh    # then the same suite (but the two end-to-end scripts) built
#                                             # with AddressSanitizer + UndefinedBehaviorSanitizer for AVX2
#                                             # in ./build-asan: about 16 more minutes on 2 cores
# The sanitizer pass is not part of CI's run (it doubled its time); run it before a
# release and after changes to parsing, file formats, memory layout or the CPU kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
# The machine's processors: nproc alone obeys OMP_NUM_THREADS, which the test suite sets to 1 for its
# processes (a build under it ran one compile at a time).
jobs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)
# CTest runs $jobs tests at once; each test process is single-threaded unless it sets its own thread
# count (the thread-count tests do). Two OpenMP teams per core wait on each other's barriers and run
# tens of times slower, which is what the default (all cores per process) did under `ctest -j`.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
bash scripts/setup.sh
# -Werror: a new compiler warning fails the suite. A unity build (each target's C++ sources compiled as one
# unit) takes a quarter less compile time on 2 cores; CUDA sources compile one by one either way.
bash scripts/build.sh -DBERT_WERROR=ON -DCMAKE_UNITY_BUILD=ON
ctest --test-dir build --output-on-failure -j "$jobs"
if [ "${BERT_SANITIZERS:-0}" != 0 ]; then
  echo "[test] the suite again under ASan + UBSan (build-asan)"
  # CPU-only: the sanitizers watch host memory (the CUDA code is built above; its tests need a GPU).
  # -g1 (line tables: file:line in the reports) compiles faster than -g; the benchmarks are not needed.
  # -O1 (the level AddressSanitizer's documentation suggests): on 2 cores the build takes 6 minutes instead
  # of -O2's 8.5 and the suite 3.6 instead of 2.8, 1.7 minutes less in all.
  # This pass targets AVX2 (x86-64-v3) while the first is native, and takes the AVX2 kernel set
  # (BERT_CPU_KERNELS=avx2: nothing AVX-512 chosen at run time), so every test runs the code an AVX2-only
  # machine runs, whatever this machine has; the kernel tests still hold every set to its reference.
  arch=portable kernels=build
  grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo && arch=avx2 kernels=avx2
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    -DBERT_SANITIZE=address,undefined -DBERT_CUDA=OFF -DBERT_BUILD_BENCH=OFF -DBERT_ARCH=$arch -DBERT_WERROR=ON \
    -DCMAKE_UNITY_BUILD=ON > /dev/null
  cmake --build build-asan -j "$jobs" > build-asan/build.log 2>&1 || { tail -30 build-asan/build.log; exit 1; }
  # allocator_may_return_null: the fuzz regression inputs make libhdf5 attempt huge mallocs, which
  # real malloc refuses (HDF5 then fails cleanly); lsan.supp: one leak inside libhdf5 (see the file).
  BERT_CPU_KERNELS=$kernels ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1 \
  LSAN_OPTIONS=suppressions=$PWD/tests/fuzz/lsan.supp \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j "$jobs" -E '^(PipelineSmoke|HfWorkflow)$'
  # PipelineSmoke (the end-to-end demo, 3-4 minutes under the sanitizers) and HfWorkflow (a minute)
  # run in the first pass only: their code paths run under the sanitizers through the unit tests
  # (store_tests, export_tests, train_tests) and Reliability (every tool's error paths).
fi
