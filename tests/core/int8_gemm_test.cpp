// The integer GEMM kernels (every one this CPU runs) against the plain reference: bit-identical outputs
// for odd and large shapes, saturating activations, padding left alone; quantization as fake
// quantization rounds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/cpu_kernels.h"
#include "core/graph.h"
#include "core/int8_gemm.h"
#include "core/ops.h"
#include "core/rng.h"
#include "core/vector_math.h"

namespace bert {
namespace {

struct Int8Case {
  int64_t m, n, k;
};

std::vector<Int8Kernel> kernels_here() {
  std::vector<Int8Kernel> out;
  for (Int8Kernel k : {Int8Kernel::kGeneric, Int8Kernel::kAvx2, Int8Kernel::kAvx512Vnni})
    if (int8_kernel_supported(k)) out.push_back(k);
  return out;
}

class Int8GemmTest : public ::testing::TestWithParam<Int8Case> {};

TEST_P(Int8GemmTest, EveryKernelEqualsTheReference) {
  const Int8Case s = GetParam();
  Rng rng(static_cast<uint64_t>(s.m * 7919 + s.n * 31 + s.k));
  // Activations over the whole range, extremes included (the unsigned offset's corner cases).
  std::vector<float> x(s.m * s.k);
  for (auto& v : x) v = static_cast<float>(rng.next_normal() * 60.0);
  x[0] = 1e6f, x.back() = -1e6f;
  const float scale_x = 0.5f;
  std::vector<int8_t> w(s.n * s.k);
  for (auto& v : w) v = static_cast<int8_t>(std::clamp(std::lround(rng.next_normal() * 50.0), -127L, 127L));
  w[0] = 127, w.back() = -127;
  std::vector<float> scale_w(s.n), bias(s.n);
  for (auto& v : scale_w) v = static_cast<float>(std::exp(rng.next_normal()) * 1e-3);
  for (auto& v : bias) v = static_cast<float>(rng.next_normal());

  const int64_t row = int8_row_bytes(s.k);
  std::vector<uint8_t> a(s.m * row);
  quantize_activations(x.data(), s.m, s.k, scale_x, a.data());
  std::vector<int8_t> q_x(s.m * s.k);
  for (int64_t r = 0; r < s.m; ++r)
    for (int64_t i = 0; i < s.k; ++i) {
      // The unsigned form is q + 128 with q = round-to-even(x / scale) clamped.
      const float q = std::clamp(std::nearbyint(x[r * s.k + i] / scale_x), -128.0f, 127.0f);
      ASSERT_EQ(int(a[r * row + i]) - 128, int(q)) << "row " << r << " input " << i;
      q_x[r * s.k + i] = static_cast<int8_t>(q);
    }

  const int64_t ldy = s.n + 3;
  std::vector<float> expected(s.m * ldy, -7.0f);
  int8_linear_reference(s.m, s.n, s.k, q_x.data(), w.data(), scale_x, scale_w.data(), bias.data(), expected.data(),
                        ldy);
  const Int8Weights packed(w.data(), s.n, s.k);
  for (Int8Kernel kernel : kernels_here()) {
    std::vector<float> y(s.m * ldy, -7.0f);
    int8_linear(s.m, a.data(), packed, scale_x, scale_w.data(), bias.data(), y.data(), ldy, kernel);
    for (int64_t i = 0; i < s.m * ldy; ++i)
      ASSERT_EQ(y[i], expected[i]) << int8_kernel_name(kernel) << " at row " << i / ldy << " column " << i % ldy;
  }

  // Dynamic quantization: each row at its own scale (its largest magnitude at 127), a row of zeros too.
  if (s.m > 1)
    for (int64_t i = 0; i < s.k; ++i) x[s.k + i] = 0.0f;
  std::vector<float> row_scales(s.m);
  quantize_activations_per_row(x.data(), s.m, s.k, row_scales.data(), a.data());
  for (int64_t r = 0; r < s.m; ++r) {
    float largest = 0.0f;
    for (int64_t i = 0; i < s.k; ++i) largest = std::max(largest, std::abs(x[r * s.k + i]));
    ASSERT_EQ(row_scales[r], largest > 0.0f ? largest / 127.0f : 1.0f) << "row " << r;
    for (int64_t i = 0; i < s.k; ++i) {
      const float q = std::clamp(std::nearbyint(x[r * s.k + i] / row_scales[r]), -128.0f, 127.0f);
      ASSERT_GE(q, -127.0f);  // symmetric: the largest magnitude lands on +-127
      ASSERT_EQ(int(a[r * row + i]) - 128, int(q)) << "row " << r << " input " << i;
      q_x[r * s.k + i] = static_cast<int8_t>(q);
    }
  }
  std::fill(expected.begin(), expected.end(), -7.0f);
  int8_linear_reference(s.m, s.n, s.k, q_x.data(), w.data(), 0.0f, scale_w.data(), bias.data(), expected.data(), ldy,
                        row_scales.data());
  for (Int8Kernel kernel : kernels_here()) {
    std::vector<float> y(s.m * ldy, -7.0f);
    int8_linear_per_row(s.m, a.data(), row_scales.data(), packed, scale_w.data(), bias.data(), y.data(), ldy, kernel);
    for (int64_t i = 0; i < s.m * ldy; ++i)
      ASSERT_EQ(y[i], expected[i]) << int8_kernel_name(kernel) << " per row, at row " << i / ldy << " column "
                                   << i % ldy;
  }
}

// GELU applied in the integer GEMM, block by block: the unfused output through vec::gelu, bit for bit.
TEST(Int8Gemm, GeluFinishEqualsGeluAfterwards) {
  const int64_t m = 150, n = 200, k = 96;  // several row and channel tasks, ragged edges
  Rng rng(21);
  std::vector<float> x(m * k), scale_w(n, 2e-3f), bias(n);
  for (auto& v : x) v = static_cast<float>(rng.next_normal() * 3.0);
  for (auto& v : bias) v = static_cast<float>(rng.next_normal());
  std::vector<int8_t> w(n * k);
  for (auto& v : w) v = static_cast<int8_t>(std::clamp(std::lround(rng.next_normal() * 50.0), -127L, 127L));
  std::vector<uint8_t> a(m * int8_row_bytes(k));
  quantize_activations(x.data(), m, k, 0.05f, a.data());
  const Int8Weights packed(w.data(), n, k);
  for (Int8Kernel kernel : kernels_here()) {
    std::vector<float> plain(m * n), fused(m * n);
    int8_linear(m, a.data(), packed, 0.05f, scale_w.data(), bias.data(), plain.data(), n, kernel);
    vec::gelu(plain.data(), plain.data(), m * n);
    int8_linear(m, a.data(), packed, 0.05f, scale_w.data(), bias.data(), fused.data(), n, kernel, Int8Finish::kGelu);
    ASSERT_EQ(fused, plain) << int8_kernel_name(kernel);
  }
}

// The attention's products in INT8: both activations quantized per tensor, batched over leading axes, B
// as stored or transposed; the exact integer sum times alpha and the scales, values clamped at the range.
TEST(Int8Matmul, BatchedProductsEqualTheExactIntegerSum) {
  const float scale_a = 0.05f, scale_b = 0.04f;
  const double alpha = 0.125;
  for (bool trans_b : {false, true}) {
    SCOPED_TRACE(trans_b ? "b transposed" : "b as stored");
    const int64_t batch = 6, m = 5, k = 37, n = 19;
    Rng rng(trans_b ? 31 : 32);
    std::vector<float> a(batch * m * k), b(batch * k * n);
    for (auto& v : a) v = static_cast<float>(rng.next_normal() * 2.0);
    for (auto& v : b) v = static_cast<float>(rng.next_normal() * 2.0);
    a[3] = 100.0f, b[5] = -100.0f;  // beyond 127 steps: clamped
    Tensor<float> ta(Shape{2, 3, m, k}, a), tb(trans_b ? Shape{2, 3, n, k} : Shape{2, 3, k, n}, b);
    Graph<float> g;
    EXPECT_THROW(ops::int8_matmul(g, g.constant(ta.view()), g.constant(tb.view()), scale_a, scale_b, alpha, trans_b),
                 std::exception);  // no gradient: inference only
    NoGradGuard<float> no_grad(g);
    const std::vector<float> y =
        g.to_host(ops::int8_matmul(g, g.constant(ta.view()), g.constant(tb.view()), scale_a, scale_b, alpha, trans_b));
    ASSERT_EQ(static_cast<int64_t>(y.size()), batch * m * n);
    auto q = [](float v, float s) { return std::clamp(std::nearbyint(double(v) / s), -128.0, 127.0); };
    for (int64_t item = 0; item < batch; ++item)
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < n; ++c) {
          double sum = 0;
          for (int64_t i = 0; i < k; ++i) {
            const float bv = trans_b ? b[item * n * k + c * k + i] : b[item * k * n + i * n + c];
            sum += q(a[item * m * k + r * k + i], scale_a) * q(bv, scale_b);
          }
          const double want = alpha * scale_a * scale_b * sum;
          ASSERT_NEAR(y[(item * m + r) * n + c], want, 1e-6 * std::max(1.0, std::abs(want)))
              << "item " << item << " row " << r << " column " << c;
        }
  }
}

TEST(Int8Gemm, PerRowQuantizationRejectsRowsThatAreNotFinite) {
  std::vector<float> x = {1.0f, 2.0f, 3.0f, std::nanf(""), 1.0f, 1.0f};
  std::vector<float> scales(2);
  std::vector<uint8_t> a(2 * int8_row_bytes(3));
  EXPECT_THROW(quantize_activations_per_row(x.data(), 2, 3, scales.data(), a.data()), std::exception);
}

INSTANTIATE_TEST_SUITE_P(Shapes, Int8GemmTest,
                         ::testing::Values(Int8Case{1, 1, 1}, Int8Case{3, 5, 7}, Int8Case{9, 17, 13},
                                           Int8Case{8, 32, 64}, Int8Case{17, 48, 130}, Int8Case{200, 70, 256},
                                           Int8Case{301, 768, 97}, Int8Case{97, 1000, 768}));

TEST(Int8Gemm, WithoutBiasAndKernelNames) {
  const std::vector<int8_t> w = {1, -2, 3, 4, 5, -6};  // (2, 3)
  const std::vector<int8_t> q_x = {10, 20, -30};
  std::vector<uint8_t> a(int8_row_bytes(3));
  const std::vector<float> x = {10.0f, 20.0f, -30.0f}, scale_w = {1.0f, 0.5f};
  quantize_activations(x.data(), 1, 3, 1.0f, a.data());
  std::vector<float> y(2);
  int8_linear(1, a.data(), Int8Weights(w.data(), 2, 3), 1.0f, scale_w.data(), nullptr, y.data(), 2);
  EXPECT_EQ(y[0], 10 - 40 - 90);
  EXPECT_EQ(y[1], 0.5f * (40 + 100 + 180));
  EXPECT_STREQ(int8_kernel_name(Int8Kernel::kAuto), int8_kernel_name(best_int8_kernel()));
  EXPECT_TRUE(int8_kernel_supported(best_int8_kernel()));
  // VNNI exactly where the AVX-512 set runs (not under BERT_CPU_KERNELS=build or avx2), then AVX2, then plain C++.
  const Int8Kernel expected =
      best_cpu_kernels() == CpuKernels::kAvx512 && int8_kernel_supported(Int8Kernel::kAvx512Vnni)
          ? Int8Kernel::kAvx512Vnni
      : int8_kernel_supported(Int8Kernel::kAvx2) ? Int8Kernel::kAvx2
                                                 : Int8Kernel::kGeneric;
  EXPECT_EQ(best_int8_kernel(), expected);
}

}  // namespace
}  // namespace bert
