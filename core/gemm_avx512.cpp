// Eigen's product compiled for AVX-512 inside a build for any x86-64. Nothing compiled here for AVX-512
// may be shared with the rest of the program, or the linker could keep this copy of an inline function
// for every caller and run AVX-512 code on a CPU without it. So the standard library comes in first,
// compiled for the build's target; Eigen follows under the AVX-512 target with its namespace renamed
// (Eigen_avx512), and our functions live in bert::gemm_avx512. tests/check_gemm_isolation.sh holds the
// object file to that: every definition it makes is in one of those two namespaces.
#include <bits/stdc++.h>  // every standard header Eigen uses, before the target changes

#include "core/gemm_avx512.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512cd,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
#define Eigen Eigen_avx512
#include <Eigen/Core>

namespace bert::gemm_avx512 {

namespace {
#include "core/gemm_eigen.inc"
}  // namespace

void one_thread(GemmArgs g, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                int64_t ldc) {
  eigen_one_thread(g, alpha, a, lda, b, ldb, beta, c, ldc);
}

void one_thread(GemmArgs g, double alpha, const double* a, int64_t lda, const double* b, int64_t ldb, double beta,
                double* c, int64_t ldc) {
  eigen_one_thread(g, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace bert::gemm_avx512

#undef Eigen
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
