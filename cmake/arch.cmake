# Instruction-set choice, made at build time:
#   -DBERT_ARCH=native   (default) everything the build machine's CPU has (AVX-512 here); the binary
#                        runs on that machine and its twins.
#   -DBERT_ARCH=avx512   x86-64-v4 (AVX-512F/BW/DQ/VL), for any AVX-512 machine.
#   -DBERT_ARCH=avx2     x86-64-v3 (AVX2 + FMA), for any Haswell-or-newer x86 machine.
#   -DBERT_ARCH=portable x86-64-v2 (SSE4.2), runs on any x86-64 machine of the last decade.
# Kernels use the vector width the compiler targets (Eigen and auto-vectorised loops), so every
# choice builds and runs; only speed differs.
include(CheckCXXCompilerFlag)
set(BERT_ARCH "native" CACHE STRING "Target instruction set: native, avx512, avx2, portable")
set_property(CACHE BERT_ARCH PROPERTY STRINGS native avx512 avx2 portable)

if(BERT_ARCH STREQUAL "native")
  set(_arch_flag "-march=native")
elseif(BERT_ARCH STREQUAL "avx512")
  set(_arch_flag "-march=x86-64-v4")
elseif(BERT_ARCH STREQUAL "avx2")
  set(_arch_flag "-march=x86-64-v3")
elseif(BERT_ARCH STREQUAL "portable")
  set(_arch_flag "-march=x86-64-v2")
else()
  message(FATAL_ERROR "BERT_ARCH='${BERT_ARCH}' is not one of: native, avx512, avx2, portable")
endif()

check_cxx_compiler_flag("${_arch_flag}" BERT_ARCH_FLAG_OK_${BERT_ARCH})
if(NOT BERT_ARCH_FLAG_OK_${BERT_ARCH})
  message(FATAL_ERROR "The compiler does not accept ${_arch_flag} (BERT_ARCH=${BERT_ARCH}); try -DBERT_ARCH=portable")
endif()
add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:${_arch_flag}>)
set(CMAKE_CXX_FLAGS_RELEASE "-O3 -DNDEBUG")
message(STATUS "BERT_ARCH=${BERT_ARCH} (${_arch_flag})")
