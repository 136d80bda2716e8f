// The vectorised kernels of kernels/vector_math.h, every set this CPU runs (the build's and the AVX-512 one),
// against plain std:: loops (the reference), over ranges that cover what the ops feed them:
// softmax/cross-entropy inputs (x - max <= 0, down to underflow) and GELU inputs (saturating tails
// included). Lengths that are not a multiple of the vector width exercise the remainder paths.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/rng.h"
#include "kernels/vector_math.h"

namespace bert {
namespace {

template <typename T>
std::vector<T> values(int64_t n, double lo, double hi, uint64_t seed) {
  Rng rng(seed);
  std::vector<T> v(n);
  for (T& x : v) x = static_cast<T>(lo + (hi - lo) * rng.next_uniform());
  return v;
}

std::vector<CpuKernels> kernel_sets_here() {
  std::vector<CpuKernels> sets = {CpuKernels::kBuild};
  if (cpu_kernels_supported(CpuKernels::kAvx512)) sets.push_back(CpuKernels::kAvx512);
  return sets;
}

// Eigen's exp (the build set) clamps its argument and may underflow to that clamp's result, 2^-128 (a
// denormal, flushed to zero in the programs: sys/float_env.h), instead of 0: seen in a portable (SSE)
// build here, and on a 16-core Intel Xeon for an x86-64-v3 binary that gives 0 on this machine. Ours
// (AVX-512) gives 0. Eigen's SSE erf (a build for x86-64-v2) is also off by up to 1.5 ulp of 1 near -1.
constexpr float kEigenExpUnderflow = std::numeric_limits<float>::min();
#if defined(__AVX2__)
constexpr double kErfUlpsOfOne = 1.0;
#else
constexpr double kErfUlpsOfOne = 1.5;
#endif

// |a - b| within `ulps` units in the last place of b (plus an absolute floor for values near 0).
template <typename T>
void expect_close(T actual, double expected, double relative, double absolute, const char* what, double at) {
  EXPECT_LE(std::abs(double(actual) - expected), relative * std::abs(expected) + absolute) << what << " at " << at;
}

TEST(VectorMath, ExpShiftedMatchesStdExp) {
  for (CpuKernels set : kernel_sets_here())
    for (int64_t n : {1, 7, 16, 33, 1000, 16001}) {
      SCOPED_TRACE(cpu_kernels_name(set));
      const auto x = values<float>(n, -100.0, 5.0, n);
      std::vector<float> out(n), added(n, 0.5f);
      vec::exp_shifted(x.data(), 3.0f, out.data(), n, set);
      vec::add_scaled_exp_shifted(x.data(), 3.0f, -2.0f, added.data(), n, set);
      double total = 0;
      for (int64_t i = 0; i < n; ++i) {
        // The argument is rounded to float first (x - shift is a float subtraction), then exp within 2 ulp.
        const double ref = std::exp(double(x[i] - 3.0f));
        expect_close(out[i], ref, 2.4e-7, 1e-37, "exp", x[i]);
        expect_close(added[i], 0.5 - 2 * ref, 2.4e-7, 1.2e-7, "0.5 - 2 exp", x[i]);
        total += ref;
      }
      EXPECT_NEAR(vec::sum_exp_shifted(x.data(), 3.0f, n, set), total, 1e-5 * total);
      double max = -1e30;
      for (float v : x) max = std::max(max, double(v));
      EXPECT_EQ(vec::max_of(x.data(), n, set), static_cast<float>(max));
      EXPECT_EQ(vec::max_of_numbers(x.data(), n, set), static_cast<float>(max));
      // NaNs anywhere are passed over, whatever comes after them; only NaNs give -inf.
      std::vector<float> with_nan = x;
      for (int64_t i = 0; i < n; i += 3) with_nan[i] = std::nanf("");
      double numbers_max = -1e30;
      for (float v : with_nan)
        if (!std::isnan(v)) numbers_max = std::max(numbers_max, double(v));
      if (n > 1) {
        EXPECT_EQ(vec::max_of_numbers(with_nan.data(), n, set), static_cast<float>(numbers_max));
      }
      const std::vector<float> only_nan(n, std::nanf(""));
      EXPECT_EQ(vec::max_of_numbers(only_nan.data(), n, set), -std::numeric_limits<float>::infinity());
      // index_of: std::find's answer for the first and last values, a repeated one, -0 for 0, a NaN and a miss.
      std::vector<float> with_repeats = with_nan;
      with_repeats[n - 1] = 0.0f;
      if (n > 2) with_repeats[n / 2] = with_repeats[n - 1 - n / 3] = 5.5f;
      for (float value : {with_repeats[0], with_repeats[n - 1], 5.5f, -0.0f, std::nanf(""), 1e30f})
        EXPECT_EQ(vec::index_of(with_repeats.data(), n, value, set),
                  std::find(with_repeats.begin(), with_repeats.end(), value) - with_repeats.begin())
            << "value " << value << ", n " << n;
    }
  // Double precision (the gradient checks run in double).
  const auto xd = values<double>(999, -50.0, 5.0, 3);
  std::vector<double> outd(999);
  vec::exp_shifted(xd.data(), 1.0, outd.data(), 999);
  for (int i = 0; i < 999; ++i) expect_close(outd[i], std::exp(xd[i] - 1.0), 1e-15, 0.0, "exp<double>", xd[i]);
}

TEST(VectorMath, GeluAndItsDerivativeMatchTheReference) {
  for (CpuKernels set : kernel_sets_here())
    for (int64_t n : {5, 64, 1001, 20000}) {
      SCOPED_TRACE(cpu_kernels_name(set));
      // Most of [-12, 12] and a dense stretch of [-4, 4], where Phi turns.
      auto x = values<float>(n, -12.0, 12.0, 10 + n);
      for (int64_t i = 0; i < n; i += 2) x[i] *= 1.0f / 3;
      const auto dy = values<float>(n, -1.0, 1.0, 20 + n);
      // The gradient added to what dx holds, and stored over garbage (a fresh buffer is not zeroed).
      std::vector<float> y(n), dx(n, 0.25f), stored(n, std::numeric_limits<float>::quiet_NaN());
      vec::gelu(x.data(), y.data(), n, set);
      vec::gelu_backward(x.data(), dy.data(), dx.data(), n, /*accumulate=*/true, set);
      vec::gelu_backward(x.data(), dy.data(), stored.data(), n, /*accumulate=*/false, set);
      for (int64_t i = 0; i < n; ++i) {
        // 1 + erf(x / sqrt 2) cancels for negative x: in float its absolute error is about one ulp of 1
        // (1.2e-7), scaled by |x| in x Phi(x); the tolerance allows that and a few ulp otherwise.
        const double v = x[i];
        const double cancellation = (set == CpuKernels::kBuild ? kErfUlpsOfOne : 1.0) * 1.2e-7 * (1 + std::abs(v));
        const double cdf = 0.5 * (1 + std::erf(v / std::sqrt(2.0)));
        expect_close(y[i], v * cdf, 1e-6, cancellation, "gelu", v);
        const double grad = cdf + v * std::exp(-0.5 * v * v) / std::sqrt(2 * M_PI);
        expect_close(dx[i], 0.25 + dy[i] * grad, 1e-6, cancellation, "gelu' added", v);
        expect_close(stored[i], dy[i] * grad, 1e-6, cancellation, "gelu' stored", v);
      }
    }
  const auto xd = values<double>(257, -9.0, 9.0, 4);
  std::vector<double> yd(257);
  vec::gelu(xd.data(), yd.data(), 257);
  for (int i = 0; i < 257; ++i)
    expect_close(yd[i], xd[i] * 0.5 * (1 + std::erf(xd[i] / std::sqrt(2.0))), 1e-14, 2.3e-16 * (1 + std::abs(xd[i])),
                 "gelu<double>", xd[i]);
}

// Softmax over one row, with and without an additive mask (0 or -10000, as the attention mask adds).
TEST(VectorMath, SoftmaxMatchesTheReference) {
  for (CpuKernels set : kernel_sets_here())
    for (int64_t n : {1, 15, 128, 131, 30522}) {
      SCOPED_TRACE(std::string(cpu_kernels_name(set)) + ", n " + std::to_string(n));
      const auto x = values<float>(n, -20.0, 20.0, 30 + n);
      std::vector<float> add(n);
      for (int64_t i = 0; i < n; ++i) add[i] = (i % 7 == 3 && n > 1) ? -10000.0f : 0.0f;
      for (const float* mask : {static_cast<const float*>(nullptr), static_cast<const float*>(add.data())}) {
        std::vector<float> y(n);
        vec::softmax(x.data(), mask, y.data(), n, set);
        double max = -1e300, total = 0;
        for (int64_t i = 0; i < n; ++i) max = std::max(max, double(x[i]) + (mask ? mask[i] : 0.0));
        for (int64_t i = 0; i < n; ++i) total += std::exp(double(x[i]) + (mask ? mask[i] : 0.0) - max);
        for (int64_t i = 0; i < n; ++i) {
          const double argument = double(x[i]) + (mask ? mask[i] : 0.0) - max;
          // x + mask - max is rounded to float (half an ulp of it: relative error |argument| 2^-24 in its
          // exp), then exp and the division add a few ulp, and the sum (in float in the build's set,
          // about n / 16 additions per lane) up to about n 1e-10.
          const double relative = 6e-7 + std::abs(argument) * 6e-8 + double(n) * 1e-10;
          expect_close(y[i], std::exp(argument) / total, relative, 1e-37, mask ? "masked softmax" : "softmax", x[i]);
        }
      }
    }
}

// Arguments beyond float's range and NaN: exp saturates to inf and 0 and keeps NaN; GELU is x on the far
// right, -0 or 0 on the far left, NaN for NaN.
TEST(VectorMath, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {-inf, -1000.0f, -104.0f, -88.0f, 0.0f, 88.0f, 88.8f, 1000.0f, inf, nan, 1.0f};
  const int64_t n = static_cast<int64_t>(x.size());
  for (CpuKernels set : kernel_sets_here()) {
    SCOPED_TRACE(cpu_kernels_name(set));
    std::vector<float> e(n), y(n);
    vec::exp_shifted(x.data(), 0.0f, e.data(), n, set);
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(x[i]))
        EXPECT_TRUE(std::isnan(e[i]));
      else if (x[i] >= 88.8f)
        EXPECT_EQ(e[i], inf) << x[i];
      else if (x[i] <= -88.8f)
        EXPECT_TRUE(e[i] >= 0.0f && e[i] <= (set == CpuKernels::kBuild ? kEigenExpUnderflow : 0.0f))
            << x[i] << ": " << e[i];
      else
        expect_close(e[i], std::exp(double(x[i])), 2.4e-7, 1e-37, "exp", x[i]);
    }
    const std::vector<float> g = {-1000.0f, -20.0f, 20.0f, 1000.0f, inf, nan, 0.0f};
    vec::gelu(g.data(), y.data(), static_cast<int64_t>(g.size()), set);
    EXPECT_EQ(y[0], 0.0f);
    EXPECT_EQ(y[1], 0.0f);
    EXPECT_EQ(y[2], 20.0f);
    EXPECT_EQ(y[3], 1000.0f);
    EXPECT_EQ(y[4], inf);
    EXPECT_TRUE(std::isnan(y[5]));
    EXPECT_EQ(y[6], 0.0f);
  }
}

}  // namespace
}  // namespace bert
