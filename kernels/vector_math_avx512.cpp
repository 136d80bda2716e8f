// The single-precision vector kernels compiled for AVX-512 inside a build for any x86-64: exp and erf
// written with intrinsics (below), and the row kernels built on them. As in kernels/gemm_avx512.cpp,
// nothing compiled here for AVX-512 may be shared with the rest of the program (the linker could keep
// this copy of an inline function for every caller): no standard-library templates, only our functions
// and intrinsics (tests/check_kernel_isolation.sh holds the object file to that).
#include <cstdint>

#include "kernels/vector_math_avx512.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512cd,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#elif defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512cd,avx512vl,avx512bw,avx512dq,avx2,fma"))), \
                             apply_to = function)
#endif
#include <immintrin.h>

namespace bert::vec_avx512 {

namespace {

constexpr int64_t kLanes = 16;
constexpr float kSqrtHalf = 0.70710678118654752f;

// The first `count` of a vector's 16 lanes (all for 16 or more).
__mmask16 lanes(int64_t count) { return count >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1); }

__m512 splat(float v) { return _mm512_set1_ps(v); }

// e^x within 2 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so n ln2 is exact), e^r by its
// Taylor series to r^7 (truncation below 6e-9), 2^n applied by scalef (overflow to inf, underflow through
// the subnormals to 0). The clamps keep n in range; NaN passes them (min/max return their second operand
// when either is NaN).
__m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(splat(-104.0f), _mm512_min_ps(splat(88.75f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, splat(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, splat(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, splat(-2.12194440e-4f), r);
  __m512 p = splat(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, splat(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, splat(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, splat(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, splat(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, splat(0.5f));
  p = _mm512_fmadd_ps(p, r, splat(1.0f));
  p = _mm512_fmadd_ps(p, r, splat(1.0f));
  return _mm512_scalef_ps(p, n);
}

// erf(z) = z P(z^2) / Q(z^2) on [-4, 4], P of degree 6 and Q of degree 4 fitted here (least squares on the
// linearised problem, reweighted toward minimax), within 7e-7 of erf in float arithmetic; z is clamped to
// [-4, 4] and the result to [-1, 1], which makes it exactly +-1 from |z| = 3.9 on, as erf rounds in float.
// 1 / Q by the reciprocal estimate and one Newton step (a division costs more). NaN stays NaN.
__m512 erf_ps(__m512 z) {
  z = _mm512_max_ps(splat(-4.0f), _mm512_min_ps(splat(4.0f), z));
  const __m512 s = _mm512_mul_ps(z, z);
  __m512 p = splat(1.921709369e-08f);
  p = _mm512_fmadd_ps(p, s, splat(-1.990295686e-06f));
  p = _mm512_fmadd_ps(p, s, splat(1.555328345e-04f));
  p = _mm512_fmadd_ps(p, s, splat(4.292909522e-03f));
  p = _mm512_fmadd_ps(p, s, splat(5.243303627e-02f));
  p = _mm512_fmadd_ps(p, s, splat(2.139414698e-01f));
  p = _mm512_fmadd_ps(p, s, splat(1.128378630e+00f));
  __m512 q = splat(1.098001492e-03f);
  q = _mm512_fmadd_ps(q, s, splat(1.555080898e-02f));
  q = _mm512_fmadd_ps(q, s, splat(1.207982823e-01f));
  q = _mm512_fmadd_ps(q, s, splat(5.229283571e-01f));
  q = _mm512_fmadd_ps(q, s, splat(1.0f));
  __m512 inverse = _mm512_rcp14_ps(q);
  inverse = _mm512_mul_ps(inverse, _mm512_fnmadd_ps(q, inverse, splat(2.0f)));
  const __m512 erf = _mm512_mul_ps(_mm512_mul_ps(z, p), inverse);
  return _mm512_max_ps(splat(-1.0f), _mm512_min_ps(splat(1.0f), erf));
}

// Sums of exps add in float within blocks of kSumBlock (16 per lane) and the blocks' sums in double: a
// row of 30,000 floats summed in 16 float lanes was off by about 1e-6 relative; this keeps it near
// float's own rounding at about the cost of float sums (converting every vector to double cost 45%).
constexpr int64_t kSumBlock = 256;

// sum_i exp(x[i] - shift), storing each exp to out[i] where out is given (out may be x).
double sum_exp(const float* x, __m512 shift, float* out, int64_t n) {
  double total = 0;
  for (int64_t block = 0; block < n; block += kSumBlock) {
    const int64_t end = block + kSumBlock < n ? block + kSumBlock : n;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = block; i < end; i += kLanes) {
      const __mmask16 m = lanes(end - i);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), shift)));
      if (out) _mm512_mask_storeu_ps(out + i, m, e);
      sum = _mm512_add_ps(sum, e);
    }
    total += _mm512_reduce_add_ps(sum);
  }
  return total;
}

}  // namespace

void exp_shifted(const float* x, float shift, float* out, int64_t n) {
  const __m512 s = splat(shift);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes(n - i);
    _mm512_mask_storeu_ps(out + i, m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), s)));
  }
}

float sum_exp_shifted(const float* x, float shift, int64_t n) {
  return static_cast<float>(sum_exp(x, splat(shift), nullptr, n));
}

float max_of(const float* x, int64_t n) {
  const __m512 lowest = splat(-__builtin_inff());
  __m512 max = lowest;
  for (int64_t i = 0; i < n; i += kLanes) max = _mm512_max_ps(max, _mm512_mask_loadu_ps(lowest, lanes(n - i), x + i));
  return _mm512_reduce_max_ps(max);
}

float max_of_numbers(const float* x, int64_t n) {
  const __m512 lowest = splat(-__builtin_inff());
  __m512 max = lowest;
  // max_ps(a, b) returns b when either is NaN: the data first, so a NaN keeps the running maximum.
  for (int64_t i = 0; i < n; i += kLanes) max = _mm512_max_ps(_mm512_mask_loadu_ps(lowest, lanes(n - i), x + i), max);
  return _mm512_reduce_max_ps(max);
}

int64_t index_of(const float* x, int64_t n, float value) {
  const __m512 v = splat(value);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes(n - i);
    const __mmask16 equal = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, x + i), v, _CMP_EQ_OQ);
    if (equal) return i + __builtin_ctz(equal);
  }
  return n;
}

void add_scaled_exp_shifted(const float* x, float shift, float scale, float* out, int64_t n) {
  const __m512 s = splat(shift), k = splat(scale);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes(n - i);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), s));
    _mm512_mask_storeu_ps(out + i, m, _mm512_fmadd_ps(k, e, _mm512_maskz_loadu_ps(m, out + i)));
  }
}

void softmax(const float* x, const float* add, float* y, int64_t n) {
  const __m512 lowest = splat(-__builtin_inff());
  __m512 max = lowest;
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes(n - i);
    __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    if (add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, add + i));
    _mm512_mask_storeu_ps(y + i, m, v);
    max = _mm512_mask_max_ps(max, m, max, v);
  }
  const double total = sum_exp(y, splat(_mm512_reduce_max_ps(max)), y, n);
  const __m512 inverse = splat(static_cast<float>(1.0 / total));
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes(n - i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, y + i), inverse));
  }
}

// y = x Phi(x) = h + h erf(x / sqrt 2), h = x / 2.
void gelu(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    const __m512 half = _mm512_mul_ps(v, splat(0.5f));
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(half, erf_ps(_mm512_mul_ps(v, splat(kSqrtHalf))), half));
  }
}

// d/dx [x Phi(x)] = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
void gelu_backward(const float* x, const float* dy, float* dx, int64_t n, bool accumulate) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    const __m512 cdf = _mm512_fmadd_ps(erf_ps(_mm512_mul_ps(v, splat(kSqrtHalf))), splat(0.5f), splat(0.5f));
    const __m512 gauss = exp_ps(_mm512_mul_ps(_mm512_mul_ps(v, v), splat(-0.5f)));
    const __m512 grad = _mm512_fmadd_ps(_mm512_mul_ps(v, splat(0.39894228040143267794f)), gauss, cdf);
    const __m512 before = accumulate ? _mm512_maskz_loadu_ps(m, dx + i) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(dx + i, m, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, dy + i), grad, before));
  }
}

}  // namespace bert::vec_avx512

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#elif defined(__clang__)
#pragma clang attribute pop
#endif
