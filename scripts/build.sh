#!/usr/bin/env bash
# Configures and builds the project in ./build (Release). Extra arguments go to CMake's configure step,
# e.g. `bash scripts/build.sh -DBERT_ARCH=portable`.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j "$jobs"
