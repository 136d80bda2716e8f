// The vectorised kernels of core/vector_math.h against plain std:: loops (the reference), over ranges
// that cover what the ops feed them: softmax/cross-entropy inputs (x - max <= 0, down to underflow)
// and GELU inputs (saturating tails included). Lengths that are not a multiple of the vector width
// exercise the remainder paths.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/rng.h"
#include "core/vector_math.h"

namespace bert {
namespace {

template <typename T>
std::vector<T> values(int64_t n, double lo, double hi, uint64_t seed) {
  Rng rng(seed);
  std::vector<T> v(n);
  for (T& x : v) x = static_cast<T>(lo + (hi - lo) * rng.next_uniform());
  return v;
}

// |a - b| within `ulps` units in the last place of b (plus an absolute floor for values near 0).
template <typename T>
void expect_close(T actual, double expected, double relative, double absolute, const char* what, double at) {
  EXPECT_LE(std::abs(double(actual) - expected), relative * std::abs(expected) + absolute) << what << " at " << at;
}

TEST(VectorMath, ExpShiftedMatchesStdExp) {
  for (int64_t n : {1, 7, 16, 33, 1000, 16001}) {
    const auto x = values<float>(n, -100.0, 5.0, n);
    std::vector<float> out(n);
    vec::exp_shifted(x.data(), 3.0f, out.data(), n);
    double total = 0;
    for (int64_t i = 0; i < n; ++i) {
      // The argument is rounded to float first (x - shift is a float subtraction), then exp within 2 ulp.
      const double ref = std::exp(double(x[i] - 3.0f));
      expect_close(out[i], ref, 2.4e-7, 1e-37, "exp", x[i]);
      total += ref;
    }
    EXPECT_NEAR(vec::sum_exp_shifted(x.data(), 3.0f, n), total, 1e-5 * total);
    double max = -1e30;
    for (float v : x) max = std::max(max, double(v));
    EXPECT_EQ(vec::max_of(x.data(), n), static_cast<float>(max));
  }
  // Double precision (the gradient checks run in double).
  const auto xd = values<double>(999, -50.0, 5.0, 3);
  std::vector<double> outd(999);
  vec::exp_shifted(xd.data(), 1.0, outd.data(), 999);
  for (int i = 0; i < 999; ++i) expect_close(outd[i], std::exp(xd[i] - 1.0), 1e-15, 0.0, "exp<double>", xd[i]);
}

TEST(VectorMath, GeluAndItsDerivativeMatchTheReference) {
  for (int64_t n : {5, 64, 1001}) {
    const auto x = values<float>(n, -12.0, 12.0, 10 + n);
    const auto dy = values<float>(n, -1.0, 1.0, 20 + n);
    std::vector<float> y(n), dx(n, 0.25f);
    vec::gelu(x.data(), y.data(), n);
    vec::gelu_backward_accumulate(x.data(), dy.data(), dx.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      // 1 + erf(x / sqrt 2) cancels for negative x: in float its absolute error is about one ulp of 1
      // (1.2e-7), scaled by |x| in x Phi(x); the tolerance allows that and a few ulp otherwise.
      const double v = x[i];
      const double cancellation = 1.2e-7 * (1 + std::abs(v));
      const double cdf = 0.5 * (1 + std::erf(v / std::sqrt(2.0)));
      expect_close(y[i], v * cdf, 1e-6, cancellation, "gelu", v);
      const double grad = cdf + v * std::exp(-0.5 * v * v) / std::sqrt(2 * M_PI);
      expect_close(dx[i], 0.25 + dy[i] * grad, 1e-6, cancellation, "gelu'", v);
    }
  }
  const auto xd = values<double>(257, -9.0, 9.0, 4);
  std::vector<double> yd(257);
  vec::gelu(xd.data(), yd.data(), 257);
  for (int i = 0; i < 257; ++i)
    expect_close(yd[i], xd[i] * 0.5 * (1 + std::erf(xd[i] / std::sqrt(2.0))), 1e-14, 2.3e-16 * (1 + std::abs(xd[i])),
                 "gelu<double>", xd[i]);
}

}  // namespace
}  // namespace bert
