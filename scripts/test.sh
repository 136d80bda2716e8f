#!/usr/bin/env bash
# The whole test suite: set-up, build, then every test through CTest (which reports the count).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
