#!/usr/bin/env bash
# Configures and builds the project in ./build (Release). Extra arguments go to CMake's configure step,
# e.g. `bash scripts/build.sh -DBERT_ARCH=portable`.
set -euo pipefail
cd "$(dirname "$0")/.."
# The machine's processors: nproc alone obeys OMP_NUM_THREADS, which the test suite sets to 1 for its
# processes (a build under it ran one compile at a time).
jobs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j "$jobs"
