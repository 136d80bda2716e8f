#!/usr/bin/env bash
# Every GPU test of the bundle (scripts/gpu_bundle.sh) on the GPU machine, from the repository root with $OUT set.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
timeout 500 bash gpu-bundle/run.sh tests > $OUT/gpu-tests.log 2>&1
echo "tests exit $?"
grep -E "PASSED|FAILED|tests from .* ran|SKIPPED" $OUT/gpu-tests.log
