// The single-precision one-thread GEMM compiled for AVX2 + FMA (x86-64-v3) inside a build for any x86-64,
// for CPUs without AVX-512: the same BLIS-style blocking as core/gemm_avx512.cpp (core/gemm_blocked_product.inc)
// around a register tile for 16 ymm registers. As there, nothing compiled here may be shared with the rest
// of the program (a portable build would otherwise run AVX2 code on CPUs without it): the standard headers
// come first, compiled for the build's target, and everything below lives in bert::gemm_avx2, with no
// standard-library templates (tests/check_kernel_isolation.sh holds the object file to that).
#include <cstdint>
#include <cstdlib>
#include <new>

#include "core/gemm_avx2.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#elif defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#endif
#include <immintrin.h>

namespace bert::gemm_avx2 {

namespace {

// A kMr x kNr tile of C in 12 accumulators (6 rows x two 8-float vectors), two B vectors and one broadcast
// of A per step of k: 15 of the 16 ymm registers, 2 loads per 2 FMAs. A strip of A (6 x 256 floats, 6 KB)
// and one panel of B (256 x 16, 16 KB) stay in a 32 KB L1; a slice of B (256 x 256, 256 KB) in L2.
constexpr int64_t kMr = 6, kNr = 16, kKc = 256, kNc = 256;

#include "core/gemm_packing_memory.inc"

// Lanes 0 .. count - 1 of an 8-float vector selected (all for 8 or more, none for 0 or less), as the mask
// of _mm256_maskload_ps / _mm256_maskstore_ps, which never touch the memory of unselected lanes.
__m256i lane_mask(int64_t count) {
  const int32_t n = count >= 8 ? 8 : count <= 0 ? 0 : static_cast<int32_t>(count);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 x 8 floats transposed in registers: r[i] lane j becomes r[j] lane i. Pairs of rows interleave (unpack),
// then quads (shuffle within 128-bit lanes), then the two 128-bit halves cross.
void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  __m256 u[8];  // u[4g + k], 128-bit half H: rows 4g .. 4g + 3 at column 4H + k
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

// op(B)[p0 : p0 + kc, j0 : j0 + nc] into panels of kNr columns, each kc rows of kNr (zeros past nc).
void pack_b(bool trans_b, const float* b, int64_t ldb, int64_t p0, int64_t kc, int64_t j0, int64_t nc, float* out) {
  for (int64_t jp = 0; jp < nc; jp += kNr) {
    float* panel = out + jp * kc;
    const int64_t width = smaller(kNr, nc - jp);
    if (!trans_b) {  // rows of B are contiguous: copy kNr of each
      const __m256i m0 = lane_mask(width), m1 = lane_mask(width - 8);
      for (int64_t p = 0; p < kc; ++p) {
        const float* src = b + (p0 + p) * ldb + j0 + jp;
        _mm256_store_ps(panel + p * kNr, _mm256_maskload_ps(src, m0));
        _mm256_store_ps(panel + p * kNr + 8, _mm256_maskload_ps(src + 8, m1));
      }
      continue;
    }
    // B stored (N, K): column j of op(B) is row j as stored. 8 stored rows x 8 steps of k at a time,
    // transposed in registers (the linear layer's x W^T packs its weight this way on every call).
    for (int64_t half = 0; half < kNr; half += 8) {
      const int64_t rows = width - half;  // stored rows in this half; the rest are zeros
      for (int64_t p = 0; p < kc; p += 8) {
        const int64_t steps = smaller(8, kc - p);
        const __m256i m = lane_mask(steps);
        __m256 r[8];
#pragma GCC unroll 8
        for (int64_t i = 0; i < 8; ++i)
          r[i] = i < rows ? _mm256_maskload_ps(b + (j0 + jp + half + i) * ldb + p0 + p, m) : _mm256_setzero_ps();
        transpose8(r);
#pragma GCC unroll 8
        for (int64_t q = 0; q < 8; ++q)  // a fixed count, so r stays in registers
          if (q < steps) _mm256_store_ps(panel + (p + q) * kNr + half, r[q]);
      }
    }
  }
}

// kRows rows (<= kMr) of C, kNr columns of which the first `width` are stored: C = alpha (A panel) + beta C
// + bias (beta 0: C is not read; bias null: none). A is read from its strip: row r, step p at a[r * lda + p],
// or a[p * lda + r] when kTransA.
template <int kRows, bool kTransA>
void tile(int64_t kc, const float* a, int64_t lda, const float* panel, float* c, int64_t ldc, int64_t width,
          float alpha, float beta, const float* bias) {
  __m256 acc0[kRows], acc1[kRows];
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int64_t p = 0; p < kc; ++p) {
    const __m256 b0 = _mm256_load_ps(panel + p * kNr), b1 = _mm256_load_ps(panel + p * kNr + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) {
      const __m256 av = _mm256_broadcast_ss(kTransA ? a + p * lda + r : a + r * lda + p);
      acc0[r] = _mm256_fmadd_ps(av, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(av, b1, acc1[r]);
    }
  }
  const __m256i m0 = lane_mask(width), m1 = lane_mask(width - 8);
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  const __m256 bias0 = bias ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();
  const __m256 bias1 = bias ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps();
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) {
    float* cr = c + r * ldc;
    __m256 y0 = _mm256_fmadd_ps(acc0[r], va, bias0), y1 = _mm256_fmadd_ps(acc1[r], va, bias1);
    if (beta != 0.0f) {
      y0 = _mm256_fmadd_ps(vb, _mm256_maskload_ps(cr, m0), y0);
      y1 = _mm256_fmadd_ps(vb, _mm256_maskload_ps(cr + 8, m1), y1);
    }
    if (width == kNr) {
      _mm256_storeu_ps(cr, y0);
      _mm256_storeu_ps(cr + 8, y1);
    } else {
      _mm256_maskstore_ps(cr, m0, y0);
      _mm256_maskstore_ps(cr + 8, m1, y1);
    }
  }
}

template <bool kTransA>
using TileFn = void (*)(int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t, float, float,
                        const float*);

template <bool kTransA>
TileFn<kTransA> tile_for_rows(int64_t rows) {
  switch (rows) {
    case 1:
      return &tile<1, kTransA>;
    case 2:
      return &tile<2, kTransA>;
    case 3:
      return &tile<3, kTransA>;
    case 4:
      return &tile<4, kTransA>;
    case 5:
      return &tile<5, kTransA>;
    default:
      return &tile<6, kTransA>;
  }
}

// A's rows i0 .. i0 + rows, steps p0 .. p0 + kc, copied where the tile reads them without cache conflicts:
// stored (M, K), row r at out[r * kc]; stored (K, M), step p at out[p * kMr].
template <bool kTransA>
void pack_a(const float* a, int64_t lda, int64_t i0, int64_t rows, int64_t p0, int64_t kc, float* out) {
  if (kTransA) {
    const __m256i m = lane_mask(rows);
    for (int64_t p = 0; p < kc; ++p)
      _mm256_maskstore_ps(out + p * kMr, m, _mm256_maskload_ps(a + (p0 + p) * lda + i0, m));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = a + (i0 + r) * lda + p0;
    float* dst = out + r * kc;
    for (int64_t p = 0; p < kc; p += 8) {
      const __m256i m = lane_mask(kc - p);
      _mm256_maskstore_ps(dst + p, m, _mm256_maskload_ps(src + p, m));
    }
  }
}

#include "core/gemm_blocked_product.inc"

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
