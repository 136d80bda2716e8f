#!/usr/bin/env bash
# The files compiled for AVX-512 or AVX2 inside a build for any x86-64 (kernels/gemm_avx512.cpp, kernels/gemm_avx512_bf16.cpp,
# kernels/vector_math_avx512.cpp, kernels/gemm_avx2.cpp) must define nothing outside their own namespaces: an
# inline function one of them shared with other files could be the copy the linker keeps, and a build for
# any x86-64 would then run AVX-512 (or AVX2) code on CPUs without it. And under GCC their code must really
# be of that instruction set (zmm registers; ymm FMAs for AVX2), or the run-time choice would choose nothing.
# Usage: check_kernel_isolation.sh libbert_kernels.a COMPILER_ID (CMake's: GNU, Clang, ...)
set -euo pipefail
lib=$(realpath "$1")
compiler=${2:-GNU}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
# object file, the namespaces its definitions may be in, and a pattern its instructions must show
check() {
  local object=$1 own=$2 isa=$3 pattern=$4
  ar x "$lib" "$object"
  local shared
  shared=$(nm -C --defined-only "$object" | awk '$2 ~ /^[A-Z]$/' |
    grep -v -E "$own|DW\.ref\.__gxx_personality_v0" || true)
  if [ -n "$shared" ]; then
    echo "FAIL: $object defines symbols other files may share:"
    echo "$shared" | head -20
    exit 1
  fi
  echo "ok: every definition of $object is private to it ($(nm --defined-only "$object" | wc -l) symbols)"
  local count
  count=$(objdump -d "$object" | grep -c -E "$pattern" || true)
  if [ "$compiler" = GNU ] && [ "$count" -eq 0 ]; then
    echo "FAIL: $object holds no $isa instruction"
    exit 1
  fi
  echo "ok: $isa code in $object ($count instructions)"
}
check gemm_avx512.cpp.o "Eigen_avx512::|bert::gemm_avx512::" "AVX-512 (zmm)" zmm
check vector_math_avx512.cpp.o "bert::vec_avx512::" "AVX-512 (zmm)" zmm
check gemm_avx2.cpp.o "bert::gemm_avx2::" "AVX2 FMA (ymm)" "vfmadd[0-9a-z]*ps +.*ymm"
check gemm_avx512_bf16.cpp.o "bert::gemm_avx512_bf16::" "AVX512_BF16 (vdpbf16ps)" "vdpbf16ps"
