// The AVX-512 one-thread products inside a build for any x86-64: single precision by the kernel of our own
// in kernels/gemm_blocked.inc (register-blocked, B packed into panels) over 16-float vectors, double precision by Eigen
// compiled with AVX-512 allowed (tests and gradient checks; Eigen picks its packets by macros that GCC does not set
// under a target pragma in C++, so they are the build target's). Nothing compiled here for AVX-512 may be shared with
// the rest of the program, or the linker could keep this copy of an inline function for every caller and run AVX-512
// code on a CPU without it. So the standard library comes in first, compiled for the build's target; Eigen follows
// under the AVX-512 target with its namespace renamed (Eigen_avx512), and our functions live in bert::gemm_avx512.
// tests/check_kernel_isolation.sh holds the object file to that: every definition it makes is in one of those two
// namespaces.
#include <bits/stdc++.h>  // every standard header Eigen uses, before the target changes

#include "kernels/gemm_avx512.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512cd,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
#define Eigen Eigen_avx512
#include <immintrin.h>
#include <Eigen/Core>

namespace bert::gemm_avx512 {

namespace {
#include "kernels/avx512_transpose.inc"
#include "kernels/gemm_eigen.inc"

// What kernels/gemm_blocked.inc needs of AVX-512: 16-float vectors with lane masks, and the blocking: a 12 x 32
// tile holds 24 accumulators, two B vectors and one broadcast of A; a strip of A (12 x 256 floats, 12 KB)
// stays in L1, a slice of B (256 x 512, 512 KB) in L2.
struct Ops {
  using Vec = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kLanes = 16, kMr = 12, kKc = 256, kNc = 512;
  // Lanes 0 .. count - 1 (all for 16 or more, none for 0 or less).
  static Mask mask(int64_t count) {
    return count >= 16 ? 0xFFFF : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
  }
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec load(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
  static void store(float* p, Vec v) { _mm512_store_ps(p, v); }
  static void storeu(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec load_masked(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store_masked(float* p, Mask m, Vec v) { _mm512_mask_storeu_ps(p, m, v); }
  static void transpose(Vec r[16]) { transpose16x16(r); }
};

#include "kernels/gemm_blocked.inc"

}  // namespace

void one_thread(GemmArgs g, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                int64_t ldc, const float* bias) {
  blocked_one_thread(g, alpha, a, lda, b, ldb, beta, c, ldc, bias);
}

void one_thread(GemmArgs g, double alpha, const double* a, int64_t lda, const double* b, int64_t ldb, double beta,
                double* c, int64_t ldc, const double* bias) {
  eigen_one_thread(g, alpha, a, lda, b, ldb, beta, c, ldc, bias);
}

}  // namespace bert::gemm_avx512

#undef Eigen
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
