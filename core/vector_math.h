// Vectorised elementwise math on contiguous arrays, through Eigen's packet math (AVX-512, AVX2 or SSE
// as compiled; exp within 1 ulp, float erf within a few ulp). The ops use these for their hot loops;
// tests/core/vector_math_test.cpp holds each against std::exp / std::erf.
#pragma once

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>

#include <cstdint>

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

// out[i] = exp(x[i] - shift)
template <typename T>
void exp_shifted(const T* x, T shift, T* out, int64_t n) {
  view(out, n) = (view(x, n) - shift).exp();
}

// sum_i exp(x[i] - shift)
template <typename T>
T sum_exp_shifted(const T* x, T shift, int64_t n) {
  return (view(x, n) - shift).exp().sum();
}

template <typename T>
T max_of(const T* x, int64_t n) {
  return view(x, n).maxCoeff();
}

// GELU (erf form): y = x Phi(x), and its derivative Phi(x) + x phi(x), accumulated times dy into dx.
template <typename T>
void gelu(const T* x, T* y, int64_t n) {
  const auto v = view(x, n);
  view(y, n) = T(0.5) * v * (T(1) + (v * T(0.70710678118654752440)).erf());
}
template <typename T>
void gelu_backward_accumulate(const T* x, const T* dy, T* dx, int64_t n) {
  const auto v = view(x, n);
  const auto cdf = T(0.5) * (T(1) + (v * T(0.70710678118654752440)).erf());
  const auto pdf = T(0.39894228040143267794) * (T(-0.5) * v * v).exp();
  view(dx, n) += view(dy, n) * (cdf + v * pdf);
}

}  // namespace bert::vec
