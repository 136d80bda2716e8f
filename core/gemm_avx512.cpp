// The AVX-512 one-thread products inside a build for any x86-64: single precision by a kernel of our own
// (register-blocked, B packed into panels; below), double precision by Eigen compiled with AVX-512
// allowed (tests and gradient checks; Eigen picks its packets by macros that GCC does not set under a
// target pragma in C++, so they are the build target's). Nothing compiled here for AVX-512
// may be shared with the rest of the program, or the linker could keep this copy of an inline function
// for every caller and run AVX-512 code on a CPU without it. So the standard library comes in first,
// compiled for the build's target; Eigen follows under the AVX-512 target with its namespace renamed
// (Eigen_avx512), and our functions live in bert::gemm_avx512. tests/check_kernel_isolation.sh holds the
// object file to that: every definition it makes is in one of those two namespaces.
#include <bits/stdc++.h>  // every standard header Eigen uses, before the target changes

#include "core/gemm_avx512.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512cd,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
#define Eigen Eigen_avx512
#include <immintrin.h>
#include <Eigen/Core>

namespace bert::gemm_avx512 {

namespace {
#include "core/gemm_eigen.inc"

// C = alpha op(A) op(B) + beta C in single precision, the BLIS way: the product is cut into kKc-deep
// slices of k and kNc-wide slices of columns; each slice of B is packed once into panels of kNr columns
// (zero-padded), kept in L2, and every kMr-row strip of A, copied next to it (a strip of kKc is 12 KB:
// L1; pack_a), is multiplied with each panel by a kMr x kNr register tile: 24 accumulators, two B vectors and one
// broadcast of A per step of k (2 loads per 2 FMAs: what two FMA ports need). No code here may be shared
// with other files (see the top): no standard-library templates, only our functions and intrinsics.
constexpr int64_t kMr = 12, kNr = 32, kKc = 256, kNc = 512;

#include "core/gemm_packing_memory.inc"

// The first `count` of a vector's 16 lanes (all for 16 or more, none for 0 or less).
__mmask16 lane_mask(int64_t count) {
  return count >= 16 ? 0xFFFF : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

// 16 x 16 floats transposed in registers: r[i] lane j becomes r[j] lane i. Pairs of rows interleave
// (unpack), then quads (shuffle within 128-bit lanes), then the 128-bit lanes move across (two rounds).
void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  __m512 u[16];  // u[4g + k], 128-bit lane L: rows 4g .. 4g + 3 at column 4L + k
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_shuffle_ps(t[g], t[g + 2], 0x44);
    u[g + 1] = _mm512_shuffle_ps(t[g], t[g + 2], 0xEE);
    u[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0x44);
    u[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 lo01 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x44), hi01 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xEE);
    const __m512 lo23 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x44);
    const __m512 hi23 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xEE);
    r[k] = _mm512_shuffle_f32x4(lo01, lo23, 0x88);  // 128-bit lanes 0 and 2 of each: column k
    r[4 + k] = _mm512_shuffle_f32x4(lo01, lo23, 0xDD);
    r[8 + k] = _mm512_shuffle_f32x4(hi01, hi23, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(hi01, hi23, 0xDD);
  }
}

// op(B)[p0 : p0 + kc, j0 : j0 + nc] into panels of kNr columns, each kc rows of kNr (zeros past nc).
void pack_b(bool trans_b, const float* b, int64_t ldb, int64_t p0, int64_t kc, int64_t j0, int64_t nc, float* out) {
  for (int64_t jp = 0; jp < nc; jp += kNr) {
    float* panel = out + jp * kc;
    const int64_t width = smaller(kNr, nc - jp);
    if (!trans_b) {  // rows of B are contiguous: copy kNr of each
      const __mmask16 m0 = lane_mask(width), m1 = lane_mask(width - 16);
      for (int64_t p = 0; p < kc; ++p) {
        const float* src = b + (p0 + p) * ldb + j0 + jp;
        _mm512_store_ps(panel + p * kNr, _mm512_maskz_loadu_ps(m0, src));
        _mm512_store_ps(panel + p * kNr + 16, _mm512_maskz_loadu_ps(m1, src + 16));
      }
      continue;
    }
    // B stored (N, K): column j of op(B) is row j as stored. 16 stored rows x 16 steps of k at a time,
    // transposed in registers (the linear layer's x W^T packs its weight this way on every call).
    for (int64_t half = 0; half < kNr; half += 16) {
      const int64_t rows = width - half;  // stored rows in this half; the rest are zeros
      for (int64_t p = 0; p < kc; p += 16) {
        const int64_t steps = smaller(16, kc - p);
        const __mmask16 m = lane_mask(steps);
        __m512 r[16];
#pragma GCC unroll 16
        for (int64_t i = 0; i < 16; ++i)
          r[i] = i < rows ? _mm512_maskz_loadu_ps(m, b + (j0 + jp + half + i) * ldb + p0 + p) : _mm512_setzero_ps();
        transpose16(r);
#pragma GCC unroll 16
        for (int64_t q = 0; q < 16; ++q)  // a fixed count, so r stays in registers
          if (q < steps) _mm512_store_ps(panel + (p + q) * kNr + half, r[q]);
      }
    }
  }
}

// kRows rows (<= kMr) of C, kNr columns of which the first `width` are stored: C = alpha (A panel) + beta C
// + bias (beta 0: C is not read; bias null: none). A is read in place: row r, step p at a[r * lda + p], or a[p * lda +
// r] when kTransA (A stored (K, M)).
template <int kRows, bool kTransA>
void tile(int64_t kc, const float* a, int64_t lda, const float* panel, float* c, int64_t ldc, int64_t width,
          float alpha, float beta, const float* bias) {
  __m512 acc0[kRows], acc1[kRows];
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t p = 0; p < kc; ++p) {
    const __m512 b0 = _mm512_load_ps(panel + p * kNr), b1 = _mm512_load_ps(panel + p * kNr + 16);
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      const __m512 av = _mm512_set1_ps(kTransA ? a[p * lda + r] : a[r * lda + p]);
      acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
    }
  }
  const __mmask16 m0 = lane_mask(width), m1 = lane_mask(width - 16);
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) {
    float* cr = c + r * ldc;
    __m512 y0 = _mm512_fmadd_ps(acc0[r], va, bias0), y1 = _mm512_fmadd_ps(acc1[r], va, bias1);
    if (beta != 0.0f) {
      y0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, cr), y0);
      y1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, cr + 16), y1);
    }
    _mm512_mask_storeu_ps(cr, m0, y0);
    _mm512_mask_storeu_ps(cr + 16, m1, y1);
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
    case 6:
      return &tile<6, kTransA>;
    case 7:
      return &tile<7, kTransA>;
    case 8:
      return &tile<8, kTransA>;
    case 9:
      return &tile<9, kTransA>;
    case 10:
      return &tile<10, kTransA>;
    case 11:
      return &tile<11, kTransA>;
    default:
      return &tile<12, kTransA>;
  }
}

// A's rows i0 .. i0 + rows, steps p0 .. p0 + kc, copied where the tile reads them without cache conflicts:
// stored (M, K), row r at out[r * kc] (rows of A a multiple of 4 KB apart would all fall in one set of L1);
// stored (K, M), step p at out[p * kMr] (steps of A one after another instead of lda apart).
template <bool kTransA>
void pack_a(const float* a, int64_t lda, int64_t i0, int64_t rows, int64_t p0, int64_t kc, float* out) {
  if (kTransA) {
    const __mmask16 m = lane_mask(rows);
    for (int64_t p = 0; p < kc; ++p)
      _mm512_mask_storeu_ps(out + p * kMr, m, _mm512_maskz_loadu_ps(m, a + (p0 + p) * lda + i0));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = a + (i0 + r) * lda + p0;
    float* dst = out + r * kc;
    for (int64_t p = 0; p < kc; p += 16) {
      const __mmask16 m = lane_mask(kc - p);
      _mm512_mask_storeu_ps(dst + p, m, _mm512_maskz_loadu_ps(m, src + p));
    }
  }
}

#include "core/gemm_blocked_product.inc"

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
