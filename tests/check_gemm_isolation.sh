#!/usr/bin/env bash
# The AVX-512 GEMM kernel (core/gemm_avx512.cpp) must define nothing outside its own namespaces
# (Eigen_avx512, bert::gemm_avx512): an inline function it shared with other files could be the copy the
# linker keeps, and a build for any x86-64 would then run AVX-512 code on CPUs without it. And under GCC
# its code must really be AVX-512 (zmm registers), or the run-time choice would choose nothing.
# Usage: check_gemm_isolation.sh libbert_core.a COMPILER_ID (CMake's: GNU, Clang, ...)
set -euo pipefail
lib=$(realpath "$1")
compiler=${2:-GNU}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
ar x "$lib" gemm_avx512.cpp.o
shared=$(nm -C --defined-only gemm_avx512.cpp.o | awk '$2 ~ /^[A-Z]$/' |
  grep -v -E "Eigen_avx512::|bert::gemm_avx512::|DW\.ref\.__gxx_personality_v0" || true)
if [ -n "$shared" ]; then
  echo "FAIL: core/gemm_avx512.cpp defines symbols other files may share:"
  echo "$shared" | head -20
  exit 1
fi
echo "ok: every definition of gemm_avx512.cpp.o is private to it ($(nm --defined-only gemm_avx512.cpp.o | wc -l) symbols)"
zmm=$(objdump -d gemm_avx512.cpp.o | grep -c zmm || true)
if [ "$compiler" = GNU ] && [ "$zmm" -eq 0 ]; then
  echo "FAIL: gemm_avx512.cpp.o holds no AVX-512 (zmm) instruction"
  exit 1
fi
echo "ok: AVX-512 code ($zmm instructions on zmm registers)"
