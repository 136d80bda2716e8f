// The one-thread single-precision product with BF16 operands on AVX512_BF16 (vdpbf16ps): A and B rounded to
// BF16 (nearest even) as they are packed, each pair of products summed into FP32 accumulators. Compiled for
// AVX-512 + BF16 inside a build for any x86-64 and chosen at run time where the CPU has it (kernels/gemm.h), under
// the same rules as kernels/gemm_avx512.cpp: the standard library first, compiled for the build's target, then
// only our own functions under the AVX-512 target, in bert::gemm_avx512_bf16 (tests/check_kernel_isolation.sh).
//
// The blocking is kernels/gemm_blocked.inc's: slices of B packed into panels of kNr = 32 columns kept in L2, a
// strip of kMr rows of A beside them, a kMr x kNr register tile (24 accumulators). What differs is the unit
// of k: a 4-byte pair of BF16 values (steps 2q and 2q + 1, the even step in the low half), which one
// vdpbf16ps multiplies and adds per lane; so the panels hold, for each pair of steps, 32 columns of pairs.
//
// Intel CPUs with AMX run the same panels on the tile unit instead (one_thread_amx): a panel's 16 columns
// for 16 pairs of steps are one B tile as they lie (rows 128 bytes apart), and A is packed 32 rows at a time
// with each row's pairs side by side (two A tiles); tdpbf16ps sums 16 x 16 blocks of C in tile registers.
// There vdpbf16ps runs at FP32's rate of multiply-adds (one a cycle against two FMAs), so only AMX gains.
#include <bits/stdc++.h>  // every standard header used, before the target changes

#include "kernels/gemm_avx512_bf16.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target( \
    "avx512f,avx512cd,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,amx-tile,amx-bf16")
#endif
#include <immintrin.h>

namespace bert::gemm_avx512_bf16 {

namespace {

#include "kernels/avx512_transpose.inc"
#include "kernels/gemm_pack_buffer.inc"

// A 12 x 32 tile; a strip of A (12 rows x 512 steps: 12 KB as pairs) stays in L1, a slice of B (512 steps x
// 512 columns: 512 KB as pairs) in L2, as the FP32 kernel's (whose slices are 256 steps of 4 bytes).
constexpr int64_t kLanes = 16, kMr = 12, kNr = 32, kKc = 512, kNc = 512;
static_assert(kKc % 2 == 0, "slices of k hold whole pairs");

int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }
int64_t pairs_of(int64_t steps) { return (steps + 1) / 2; }  // an odd last step pairs with a zero

// Lanes 0 .. count - 1 (all for 16 or more, none for 0 or less).
__mmask16 mask(int64_t count) {
  return count >= 16 ? 0xFFFF : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}
__m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

// 32 consecutive steps (first, then next) as 16 pairs: vcvtne2ps2bf16 puts its second operand's 16 values in
// the low half of the result, so each 4-byte lane holds steps 2i (low) and 2i + 1 (high).
__m512i consecutive_pairs(__m512 first, __m512 next) { return (__m512i)_mm512_cvtne2ps_pbh(next, first); }

// Two rows of 16 values, one step apart (even: step 2q, odd: step 2q + 1), as the 16 lanes' pairs.
__m512i interleaved_pairs(__m512 even, __m512 odd) {
  const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  return consecutive_pairs(_mm512_permutex2var_ps(even, low, odd), _mm512_permutex2var_ps(even, high, odd));
}

// op(B)[p0 : p0 + kc, j0 : j0 + nc] into panels of kNr columns, each `padded` (>= pairs_of(kc)) rows of kNr
// pairs (zeros past nc and past kc).
void pack_b(bool trans_b, const float* b, int64_t ldb, int64_t p0, int64_t kc, int64_t j0, int64_t nc, int64_t padded,
            uint32_t* out) {
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t jp = 0; jp < nc; jp += kNr) {
    uint32_t* panel = out + jp * padded;
    const int64_t width = smaller(kNr, nc - jp);
    if (!trans_b) {  // rows of B are contiguous: two rows (steps) give each column's pair
      const __mmask16 m0 = mask(width), m1 = mask(width - kLanes);
      for (int64_t q = 0; q < padded; ++q) {
        const float* even = b + (p0 + 2 * q) * ldb + j0 + jp;
        const float* odd = even + ldb;
        const bool has_even = 2 * q < kc, has_odd = 2 * q + 1 < kc;
        _mm512_store_si512(panel + q * kNr,
                           interleaved_pairs(has_even ? load(even, m0) : zero, has_odd ? load(odd, m0) : zero));
        _mm512_store_si512(panel + q * kNr + kLanes, interleaved_pairs(has_even ? load(even + kLanes, m1) : zero,
                                                                       has_odd ? load(odd + kLanes, m1) : zero));
      }
      continue;
    }
    // B stored (N, K): column j of op(B) is row j as stored, its steps side by side: 16 stored rows x 16 pairs
    // at a time, transposed in registers (a linear layer's x W^T packs its weight this way on every call).
    for (int64_t half = 0; half < kNr; half += kLanes) {
      const int64_t rows = width - half;  // stored rows in this half; the rest are zeros
      for (int64_t p = 0; p < 2 * padded; p += 2 * kLanes) {
        const __mmask16 m_first = mask(kc - p), m_next = mask(kc - p - kLanes);
        __m512 r[kLanes];
#pragma GCC unroll 16
        for (int64_t i = 0; i < kLanes; ++i) {
          const float* src = b + (j0 + jp + half + i) * ldb + p0 + p;
          r[i] =
              i < rows ? _mm512_castsi512_ps(consecutive_pairs(load(src, m_first), load(src + kLanes, m_next))) : zero;
        }
        transpose16x16(r);
        const int64_t count = smaller(kLanes, padded - p / 2);
#pragma GCC unroll 16
        for (int64_t q = 0; q < kLanes; ++q)  // a fixed count, so r stays in registers
          if (q < count) _mm512_store_ps(panel + (p / 2 + q) * kNr + half, r[q]);
      }
    }
  }
}

// A's rows i0 .. i0 + rows, steps p0 .. p0 + kc, as pairs where the tile reads them: stored (M, K), row r's
// pair q at out[r * pairs + q]; stored (K, M), at out[q * kMr + r].
template <bool kTransA>
void pack_a(const float* a, int64_t lda, int64_t i0, int64_t rows, int64_t p0, int64_t kc, uint32_t* out) {
  const int64_t pairs = pairs_of(kc);
  if (kTransA) {
    const __mmask16 m = mask(rows);
    for (int64_t q = 0; q < pairs; ++q) {
      const float* even = a + (p0 + 2 * q) * lda + i0;
      const __m512 odd = 2 * q + 1 < kc ? load(even + lda, m) : _mm512_setzero_ps();
      _mm512_mask_storeu_epi32(out + q * kMr, m, interleaved_pairs(load(even, m), odd));
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = a + (i0 + r) * lda + p0;
    uint32_t* dst = out + r * pairs;
    for (int64_t p = 0; p < kc; p += 2 * kLanes)
      _mm512_mask_storeu_epi32(
          dst + p / 2, mask(pairs - p / 2),
          consecutive_pairs(load(src + p, mask(kc - p)), load(src + p + kLanes, mask(kc - p - kLanes))));
  }
}

// One row of C from its two accumulators (kNr columns; masks m0, m1 for the first and second 16):
// alpha acc + bias + beta C (C is not read when beta is 0).
inline void store_row(float* cr, __m512 acc0, __m512 acc1, __m512 va, __m512 vb, __m512 bias0, __m512 bias1,
                      __mmask16 m0, __mmask16 m1, float beta) {
  __m512 y0 = _mm512_fmadd_ps(acc0, va, bias0), y1 = _mm512_fmadd_ps(acc1, va, bias1);
  if (beta != 0.0f) {
    y0 = _mm512_fmadd_ps(vb, load(cr, m0), y0);
    y1 = _mm512_fmadd_ps(vb, load(cr + kLanes, m1), y1);
  }
  _mm512_mask_storeu_ps(cr, m0, y0);
  _mm512_mask_storeu_ps(cr + kLanes, m1, y1);
}

// kRows rows (<= kMr) of C, kNr columns of which the first `width` are stored: C = alpha (A B) + beta C + bias
// (beta 0: C is not read; bias null: none). A's pair q of row r is a[r * lda + q], or a[q * lda + r] when kTransA.
template <int kRows, bool kTransA>
void tile(int64_t pairs, const uint32_t* a, int64_t lda, const uint32_t* panel, float* c, int64_t ldc, int64_t width,
          float alpha, float beta, const float* bias) {
  __m512 acc0[kRows], acc1[kRows];
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t q = 0; q < pairs; ++q) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512(panel + q * kNr);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(panel + q * kNr + kLanes);
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(kTransA ? a[q * lda + r] : a[r * lda + q]));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], av, b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], av, b1);
    }
  }
  const __mmask16 m0 = mask(width), m1 = mask(width - kLanes);
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  const __m512 bias0 = bias ? load(bias, m0) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? load(bias + kLanes, m1) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) store_row(c + r * ldc, acc0[r], acc1[r], va, vb, bias0, bias1, m0, m1, beta);
}

template <bool kTransA>
using TileFn = void (*)(int64_t, const uint32_t*, int64_t, const uint32_t*, float*, int64_t, int64_t, float, float,
                        const float*);

// The tile for `rows` rows (1 .. kMr; kMr for more).
template <bool kTransA, int kRows = kMr>
TileFn<kTransA> tile_for_rows(int64_t rows) {
  if constexpr (kRows == 1)
    return &tile<1, kTransA>;
  else
    return rows >= kRows ? &tile<kRows, kTransA> : tile_for_rows<kTransA, kRows - 1>(rows);
}

template <bool kTransA>
void packed_product(GemmArgs g, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                    float* c, int64_t ldc, const float* bias) {
  const int64_t panel_words = (kKc / 2) * ((smaller(kNc, g.n) + kNr - 1) / kNr * kNr);
  uint32_t* panels = packing_memory<uint32_t>(panel_words + (kKc / 2) * kMr);
  uint32_t* a_strip = panels + panel_words;
  for (int64_t p0 = 0; p0 < g.k; p0 += kKc) {
    const int64_t kc = smaller(kKc, g.k - p0), pairs = pairs_of(kc);
    // Later slices of k add to what the first wrote (which added the bias).
    const float beta_here = p0 == 0 ? beta : 1.0f;
    const float* bias_here = p0 == 0 ? bias : nullptr;
    for (int64_t j0 = 0; j0 < g.n; j0 += kNc) {
      const int64_t nc = smaller(kNc, g.n - j0);
      pack_b(g.trans_b, b, ldb, p0, kc, j0, nc, pairs, panels);
      for (int64_t i0 = 0; i0 < g.m; i0 += kMr) {
        const int64_t rows = smaller(kMr, g.m - i0);
        const TileFn<kTransA> run = tile_for_rows<kTransA>(rows);
        pack_a<kTransA>(a, lda, i0, rows, p0, kc, a_strip);
        const int64_t strip_ld = kTransA ? kMr : pairs;
        for (int64_t jp = 0; jp < nc; jp += kNr)
          run(pairs, a_strip, strip_ld, panels + jp * pairs, c + i0 * ldc + j0 + jp, ldc, smaller(kNr, nc - jp), alpha,
              beta_here, bias_here ? bias_here + j0 + jp : nullptr);
      }
    }
  }
}

// ---- AMX: two row tiles (32 rows of A) by a panel's two column tiles (32 columns), 16 pairs of steps a
// step. Tiles: sums of C in tmm0-3 (row tile i, column tile j at 2i + j), A in tmm4-5, B in tmm6-7; every
// tile 16 rows of 64 bytes.
constexpr int64_t kAmxRows = 32, kAmxPairs = 16;  // rows of A per strip; pairs of steps per tile

#include "kernels/amx_tiles.inc"

// A's rows i0 .. i0 + rows (zero rows up to kAmxRows), steps p0 .. p0 + kc, each row's `padded` pairs side by
// side (zeros past kc): row r's pair q at out[r * padded + q], the A tiles' layout.
void pack_a_rows(bool trans_a, const float* a, int64_t lda, int64_t i0, int64_t rows, int64_t p0, int64_t kc,
                 int64_t padded, uint32_t* out) {
  const __m512 zero = _mm512_setzero_ps();
  if (!trans_a) {
    for (int64_t r = 0; r < kAmxRows; ++r) {
      const float* src = a + (i0 + r) * lda + p0;
      uint32_t* dst = out + r * padded;
      for (int64_t p = 0; p < 2 * padded; p += 2 * kLanes) {
        const __m512i v =
            r < rows ? consecutive_pairs(load(src + p, mask(kc - p)), load(src + p + kLanes, mask(kc - p - kLanes)))
                     : _mm512_setzero_si512();
        _mm512_store_si512(dst + p / 2, v);
      }
    }
    return;
  }
  // Stored (K, M): two stored rows (steps) give 16 rows' pairs in one vector; 16 such vectors (pairs) are
  // transposed in registers into 16 rows of 16 pairs.
  for (int64_t r0 = 0; r0 < kAmxRows; r0 += kLanes) {
    const __mmask16 m = mask(rows - r0);
    for (int64_t q0 = 0; q0 < padded; q0 += kLanes) {
      __m512 v[kLanes];
#pragma GCC unroll 16
      for (int64_t q = 0; q < kLanes; ++q) {
        const int64_t step = 2 * (q0 + q);
        const float* even = a + (p0 + step) * lda + i0 + r0;
        v[q] = _mm512_castsi512_ps(
            interleaved_pairs(step < kc ? load(even, m) : zero, step + 1 < kc ? load(even + lda, m) : zero));
      }
      transpose16x16(v);
#pragma GCC unroll 16
      for (int64_t i = 0; i < kLanes; ++i) _mm512_store_ps(out + (r0 + i) * padded + q0, v[i]);
    }
  }
}

// C (32 x 32 floats, rows 32 apart) = the strip's 32 rows times one panel's 32 columns over `padded` pairs.
void amx_block(int64_t padded, const uint32_t* strip, const uint32_t* panel, float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t strip_bytes = padded * 4, panel_bytes = kNr * 4;
  for (int64_t q0 = 0; q0 < padded; q0 += kAmxPairs) {
    _tile_loadd(4, strip + q0, strip_bytes);
    _tile_loadd(5, strip + kLanes * padded + q0, strip_bytes);
    _tile_loadd(6, panel + q0 * kNr, panel_bytes);
    _tile_loadd(7, panel + q0 * kNr + kLanes, panel_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  constexpr int64_t kSumBytes = kNr * 4;
  _tile_stored(0, sums, kSumBytes);
  _tile_stored(1, sums + kLanes, kSumBytes);
  _tile_stored(2, sums + kLanes * kNr, kSumBytes);
  _tile_stored(3, sums + kLanes * kNr + kLanes, kSumBytes);
}

void packed_product_amx(GemmArgs g, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                        float* c, int64_t ldc, const float* bias) {
  static_assert((kKc / 2) % kAmxPairs == 0, "a slice of k is whole tiles");
  const int64_t panel_words = (kKc / 2) * ((smaller(kNc, g.n) + kNr - 1) / kNr * kNr);
  uint32_t* panels = packing_memory<uint32_t>(panel_words + (kKc / 2) * kAmxRows);
  uint32_t* a_strip = panels + panel_words;
  alignas(64) float sums[kAmxRows * kNr];
  const __m512 va = _mm512_set1_ps(alpha);
  load_tile_config();
  for (int64_t p0 = 0; p0 < g.k; p0 += kKc) {
    const int64_t kc = smaller(kKc, g.k - p0);
    const int64_t padded = (pairs_of(kc) + kAmxPairs - 1) / kAmxPairs * kAmxPairs;
    const float beta_here = p0 == 0 ? beta : 1.0f;
    const float* bias_here = p0 == 0 ? bias : nullptr;
    const __m512 vb = _mm512_set1_ps(beta_here);
    for (int64_t j0 = 0; j0 < g.n; j0 += kNc) {
      const int64_t nc = smaller(kNc, g.n - j0);
      pack_b(g.trans_b, b, ldb, p0, kc, j0, nc, padded, panels);
      for (int64_t i0 = 0; i0 < g.m; i0 += kAmxRows) {
        const int64_t rows = smaller(kAmxRows, g.m - i0);
        pack_a_rows(g.trans_a, a, lda, i0, rows, p0, kc, padded, a_strip);
        for (int64_t jp = 0; jp < nc; jp += kNr) {
          amx_block(padded, a_strip, panels + jp * padded, sums);
          const int64_t width = smaller(kNr, nc - jp);
          const __mmask16 m0 = mask(width), m1 = mask(width - kLanes);
          const float* bias_block = bias_here ? bias_here + j0 + jp : nullptr;
          const __m512 bias0 = bias_block ? load(bias_block, m0) : _mm512_setzero_ps();
          const __m512 bias1 = bias_block ? load(bias_block + kLanes, m1) : _mm512_setzero_ps();
          for (int64_t r = 0; r < rows; ++r)
            store_row(c + (i0 + r) * ldc + j0 + jp, _mm512_load_ps(sums + r * kNr),
                      _mm512_load_ps(sums + r * kNr + kLanes), va, vb, bias0, bias1, m0, m1, beta_here);
        }
      }
    }
  }
  asm volatile("tilerelease");
}

// C = beta C (+ bias) for an empty inner dimension; beta 0 writes zeros (C is not read). Whether k was empty.
bool empty_product(GemmArgs g, float beta, float* c, int64_t ldc, const float* bias) {
  if (g.k != 0) return false;
  for (int64_t i = 0; i < g.m; ++i)
    for (int64_t j = 0; j < g.n; ++j)
      c[i * ldc + j] = (beta == 0.0f ? 0.0f : beta * c[i * ldc + j]) + (bias ? bias[j] : 0.0f);
  return true;
}

}  // namespace

void one_thread(GemmArgs g, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                int64_t ldc, const float* bias) {
  if (g.m == 0 || g.n == 0 || empty_product(g, beta, c, ldc, bias)) return;
  if (g.trans_a)
    packed_product<true>(g, alpha, a, lda, b, ldb, beta, c, ldc, bias);
  else
    packed_product<false>(g, alpha, a, lda, b, ldb, beta, c, ldc, bias);
}

void one_thread_amx(GemmArgs g, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                    float* c, int64_t ldc, const float* bias) {
  if (g.m == 0 || g.n == 0 || empty_product(g, beta, c, ldc, bias)) return;
  packed_product_amx(g, alpha, a, lda, b, ldb, beta, c, ldc, bias);
}

}  // namespace bert::gemm_avx512_bf16

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
