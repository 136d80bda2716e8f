// Vectorised elementwise math on contiguous arrays. Two sets (kernels/cpu_kernels.h): Eigen's packet math
// compiled for the build's instruction set (AVX-512, AVX2 or SSE; exp within 1 ulp, float erf within a
// few ulp), for float and double, and single-precision kernels of our own compiled for AVX-512
// (kernels/vector_math_avx512.cpp), chosen at run time where the CPU has AVX-512. The ops use these for
// their hot loops; tests/kernels/vector_math_test.cpp holds each set against std::exp / std::erf.
#pragma once

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels/cpu_kernels.h"
#include "kernels/vector_math_avx512.h"

namespace bert::vec {

template <typename T>
using Array = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>, Eigen::Unaligned>;
template <typename T>
using ConstArray = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>, Eigen::Unaligned>;

template <typename T>
ConstArray<T> view(const T* p, int64_t n) {
  return ConstArray<T>(p, n);
}
template <typename T>
Array<T> view(T* p, int64_t n) {
  return Array<T>(p, n);
}

// The build's set.
namespace build {

template <typename T>
void exp_shifted(const T* x, T shift, T* out, int64_t n) {
  view(out, n) = (view(x, n) - shift).exp();
}
template <typename T>
T sum_exp_shifted(const T* x, T shift, int64_t n) {
  return (view(x, n) - shift).exp().sum();
}
template <typename T>
T max_of(const T* x, int64_t n) {
  return view(x, n).maxCoeff();
}
template <typename T>
T max_of_numbers(const T* x, int64_t n) {
  const T max = view(x, n).template maxCoeff<Eigen::PropagateNumbers>();  // NaN when every value is
  return max == max ? max : -std::numeric_limits<T>::infinity();
}
template <typename T>
int64_t index_of(const T* x, int64_t n, T value) {
  return std::find(x, x + n, value) - x;
}
template <typename T>
void add_scaled_exp_shifted(const T* x, T shift, T scale, T* out, int64_t n) {
  view(out, n) += scale * (view(x, n) - shift).exp();
}
template <typename T>
void softmax(const T* x, const T* add, T* y, int64_t n) {
  auto o = view(y, n);
  if (add)
    o = view(x, n) + view(add, n);
  else
    o = view(x, n);
  o = (o - o.maxCoeff()).exp();
  o *= T(1) / o.sum();
}
template <typename T>
void gelu(const T* x, T* y, int64_t n) {
  const auto v = view(x, n);
  view(y, n) = T(0.5) * v * (T(1) + (v * T(0.70710678118654752440)).erf());
}
template <typename T>
void gelu_backward(const T* x, const T* dy, T* dx, int64_t n, bool accumulate) {
  const auto v = view(x, n);
  const auto cdf = T(0.5) * (T(1) + (v * T(0.70710678118654752440)).erf());
  const auto pdf = T(0.39894228040143267794) * (T(-0.5) * v * v).exp();
  if (accumulate)
    view(dx, n) += view(dy, n) * (cdf + v * pdf);
  else
    view(dx, n) = view(dy, n) * (cdf + v * pdf);
}

}  // namespace build

// The entry points: float runs the chosen set (kAuto: the best this CPU runs), double the build's.
inline bool float_avx512(CpuKernels kernels) { return resolve_cpu_kernels(kernels) == CpuKernels::kAvx512; }

// out[i] = exp(x[i] - shift)
template <typename T>
void exp_shifted(const T* x, T shift, T* out, int64_t n, CpuKernels kernels = CpuKernels::kAuto) {
  if constexpr (std::is_same_v<T, float>)
    if (float_avx512(kernels)) return vec_avx512::exp_shifted(x, shift, out, n);
  return build::exp_shifted(x, shift, out, n);
}
// sum_i exp(x[i] - shift)
template <typename T>
T sum_exp_shifted(const T* x, T shift, int64_t n, CpuKernels kernels = CpuKernels::kAuto) {
  if constexpr (std::is_same_v<T, float>)
    if (float_avx512(kernels)) return vec_avx512::sum_exp_shifted(x, shift, n);
  return build::sum_exp_shifted(x, shift, n);
}
// max_i x[i], n >= 1
template <typename T>
T max_of(const T* x, int64_t n, CpuKernels kernels = CpuKernels::kAuto) {
  if constexpr (std::is_same_v<T, float>)
    if (float_avx512(kernels)) return vec_avx512::max_of(x, n);
  return build::max_of(x, n);
}
// max_i x[i] over the values that are not NaN (-inf when all are), n >= 1
template <typename T>
T max_of_numbers(const T* x, int64_t n, CpuKernels kernels = CpuKernels::kAuto) {
  if constexpr (std::is_same_v<T, float>)
    if (float_avx512(kernels)) return vec_avx512::max_of_numbers(x, n);
  return build::max_of_numbers(x, n);
}
// The first i with x[i] == value (as std::find compares: -0 equals 0, NaN equals nothing), n when none.
template <typename T>
int64_t index_of(const T* x, int64_t n, T value, CpuKernels kernels = CpuKernels::kAuto) {
  if constexpr (std::is_same_v<T, float>)
    if (float_avx512(kernels)) return vec_avx512::index_of(x, n, value);
  return build::index_of(x, n, value);
}
// out[i] += scale exp(x[i] - shift)
template <typename T>
void add_scaled_exp_shifted(const T* x, T shift, T scale, T* out, int64_t n, CpuKernels kernels = CpuKernels::kAuto) {
  if constexpr (std::is_same_v<T, float>)
    if (float_avx512(kernels)) return vec_avx512::add_scaled_exp_shifted(x, shift, scale, out, n);
  return build::add_scaled_exp_shifted(x, shift, scale, out, n);
}
// y = softmax(x + add) over one row of n (add may be null)
template <typename T>
void softmax(const T* x, const T* add, T* y, int64_t n, CpuKernels kernels = CpuKernels::kAuto) {
  if constexpr (std::is_same_v<T, float>)
    if (float_avx512(kernels)) return vec_avx512::softmax(x, add, y, n);
  return build::softmax(x, add, y, n);
}
// GELU (erf form): y = x Phi(x), and its derivative Phi(x) + x phi(x) times dy, stored into dx or added
// to it (accumulate).
template <typename T>
void gelu(const T* x, T* y, int64_t n, CpuKernels kernels = CpuKernels::kAuto) {
  if constexpr (std::is_same_v<T, float>)
    if (float_avx512(kernels)) return vec_avx512::gelu(x, y, n);
  return build::gelu(x, y, n);
}
template <typename T>
void gelu_backward(const T* x, const T* dy, T* dx, int64_t n, bool accumulate, CpuKernels kernels = CpuKernels::kAuto) {
  if constexpr (std::is_same_v<T, float>)
    if (float_avx512(kernels)) return vec_avx512::gelu_backward(x, dy, dx, n, accumulate);
  return build::gelu_backward(x, dy, dx, n, accumulate);
}

}  // namespace bert::vec
