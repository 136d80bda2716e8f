// The single-precision one-thread GEMM compiled for AVX2 + FMA (x86-64-v3) inside a build for any x86-64,
// for CPUs without AVX-512: kernels/gemm_blocked.inc (the kernel kernels/gemm_avx512.cpp compiles for AVX-512)
// over 8-float vectors and a register tile for 16 ymm registers. As there, nothing compiled here may be shared with the
// rest of the program (a portable build would otherwise run AVX2 code on CPUs without it): the standard headers come
// first, compiled for the build's target, and everything below lives in bert::gemm_avx2, with no standard-library
// templates (tests/check_kernel_isolation.sh holds the object file to that).
#include <cstdint>
#include <cstdlib>
#include <new>

#include "kernels/gemm_avx2.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#elif defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#endif
#include <immintrin.h>

namespace bert::gemm_avx2 {

namespace {

// What kernels/gemm_blocked.inc needs of AVX2: 8-float vectors with masks for _mm256_maskload_ps and
// _mm256_maskstore_ps (which never touch the memory of unselected lanes), and the blocking: a 6 x 16 tile
// holds 12 accumulators, two B vectors and one broadcast of A (15 of the 16 ymm registers); a strip of A
// (6 x 256 floats, 6 KB) and one panel of B (256 x 16, 16 KB) stay in a 32 KB L1, a slice of B (256 x 256,
// 256 KB) in L2.
struct Ops {
  using Vec = __m256;
  using Mask = __m256i;
  static constexpr int64_t kLanes = 8, kMr = 6, kKc = 256, kNc = 256;
  // Lanes 0 .. count - 1 (all for 8 or more, none for 0 or less).
  static Mask mask(int64_t count) {
    const int32_t n = count >= 8 ? 8 : count <= 0 ? 0 : static_cast<int32_t>(count);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec load(const float* p) { return _mm256_load_ps(p); }  // 32-byte aligned
  static void store(float* p, Vec v) { _mm256_store_ps(p, v); }
  static void storeu(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec load_masked(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
  static void store_masked(float* p, Mask m, Vec v) { _mm256_maskstore_ps(p, m, v); }
  // 8 x 8 floats: r[i] lane j becomes r[j] lane i. Pairs of rows interleave (unpack), then quads (shuffle
  // within 128-bit lanes), then the two 128-bit halves cross.
  static void transpose(Vec r[8]) {
    Vec t[8];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    Vec u[8];  // u[4g + k], 128-bit half H: rows 4g .. 4g + 3 at column 4H + k
    for (int g = 0; g < 8; g += 4) {
      u[g] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
      u[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xEE);
      u[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
      u[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) {
      r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
      r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
  }
};

#include "kernels/gemm_blocked.inc"

}  // namespace

void one_thread(GemmArgs g, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                int64_t ldc, const float* bias) {
  blocked_one_thread(g, alpha, a, lda, b, ldb, beta, c, ldc, bias);
}

}  // namespace bert::gemm_avx2

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#elif defined(__clang__)
#pragma clang attribute pop
#endif
