// The integer GEMM kernels (every one this CPU runs) against the plain reference: bit-identical outputs
// for odd and large shapes, saturating activations, padding left alone; quantization as fake
// quantization rounds.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "core/graph.h"
#include "core/rng.h"
#include "kernels/cpu_kernels.h"
#include "kernels/int8_gemm.h"
#include "kernels/vector_math.h"
#include "ops/ops.h"

namespace bert {
namespace {

struct Int8Case {
  int64_t m, n, k;
};

std::vector<Int8Kernel> kernels_here() {
  std::vector<Int8Kernel> out;
  for (Int8Kernel k : {Int8Kernel::kGeneric, Int8Kernel::kAvx2, Int8Kernel::kAvx512Vnni, Int8Kernel::kAmx})
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

// The per-row product made tile by tile: every element handed over once, in tiles no larger than asked, bit for
// bit int8_linear_per_row's values, on every kernel and on one and two threads; tiles must be whole blocks.
TEST(Int8Gemm, TilesCoverThePerRowProductOnceWithItsValues) {
  const int64_t m = 150, n = 200, k = 96;  // ragged in both directions
  Rng rng(33);
  std::vector<float> x(m * k), scale_w(n), bias(n);
  for (auto& v : x) v = static_cast<float>(rng.next_normal() * 3.0);
  for (auto& v : scale_w) v = static_cast<float>(std::exp(rng.next_normal()) * 1e-3);
  for (auto& v : bias) v = static_cast<float>(rng.next_normal());
  std::vector<int8_t> w(n * k);
  for (auto& v : w) v = static_cast<int8_t>(std::clamp(std::lround(rng.next_normal() * 50.0), -127L, 127L));
  std::vector<uint8_t> a(m * int8_row_bytes(k));
  std::vector<float> row_scales(m);
  quantize_activations_per_row(x.data(), m, k, row_scales.data(), a.data());
  const Int8Weights packed(w.data(), n, k);
  const int saved = omp_get_max_threads();
  for (Int8Kernel kernel : kernels_here())
    for (int threads : {1, 2}) {
      SCOPED_TRACE(std::string(int8_kernel_name(kernel)) + " threads " + std::to_string(threads));
      omp_set_num_threads(threads);
      std::vector<float> whole(m * n), tiled(m * n, -7.0f);
      int8_linear_per_row(m, a.data(), row_scales.data(), packed, scale_w.data(), bias.data(), whole.data(), n, kernel);
      std::vector<std::atomic<int>> visits(m * n);
      std::atomic<bool> oversized{false};
      const int64_t tile_rows = 37, tile_cols = 48;
      int8_linear_per_row_tiles(
          m, a.data(), row_scales.data(), packed, scale_w.data(), bias.data(), tile_rows, tile_cols,
          [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, const float* tile, int64_t ld) {
            if (r1 - r0 > tile_rows || c1 - c0 > tile_cols || ld < c1 - c0) oversized = true;
            for (int64_t i = r0; i < r1; ++i)
              for (int64_t j = c0; j < c1; ++j) {
                ++visits[i * n + j];
                tiled[i * n + j] = tile[(i - r0) * ld + (j - c0)];
              }
          },
          kernel);
      ASSERT_FALSE(oversized);
      for (int64_t at = 0; at < m * n; ++at) ASSERT_EQ(visits[at].load(), 1) << "(" << at / n << ", " << at % n << ")";
      ASSERT_EQ(tiled, whole);
    }
  omp_set_num_threads(saved);
  const auto nothing = [](int64_t, int64_t, int64_t, int64_t, const float*, int64_t) {};
  EXPECT_THROW(
      int8_linear_per_row_tiles(m, a.data(), row_scales.data(), packed, scale_w.data(), bias.data(), 32, 40, nothing),
      std::exception);  // 40 columns: not whole blocks of 16
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

// Quantizing and packing in one step (an activation used as weights, as it lies or transposed) gives the
// bytes and offsets of quantizing first and packing the integers; a reused object leaves no stale bytes.
TEST(Int8Weights, QuantizePackEqualsQuantizingThenPacking) {
  const float scale = 0.05f;
  Int8Weights reused;
  reused.quantize_pack(std::vector<float>(40 * 70, 9.0f).data(), 40, 70, 70, 1, scale);  // larger, all 127
  for (bool transposed : {false, true}) {
    SCOPED_TRACE(transposed ? "columns in memory" : "rows in memory");
    const int64_t n = 19, k = 37;
    Rng rng(transposed ? 41 : 42);
    std::vector<float> src(n * k);
    for (auto& v : src) v = static_cast<float>(rng.next_normal() * 3.0);
    src[4] = 100.0f, src[9] = -100.0f, src[11] = 2.5f * scale, src[12] = -3.5f * scale;  // clamped; ties to even
    std::vector<int8_t> q(n * k);
    for (int64_t c = 0; c < n; ++c)
      for (int64_t i = 0; i < k; ++i) {
        const float v = transposed ? src[i * n + c] : src[c * k + i];
        q[c * k + i] = static_cast<int8_t>(std::clamp(std::nearbyint(v / scale), -128.0f, 127.0f));
      }
    const Int8Weights expected(q.data(), n, k);
    reused.quantize_pack(src.data(), n, k, transposed ? 1 : k, transposed ? n : 1, scale);
    ASSERT_EQ(reused.n(), n);
    ASSERT_EQ(reused.k(), k);
    ASSERT_EQ(reused.blocks(), expected.blocks());
    const int64_t bytes = expected.blocks() * 16 * expected.k_padded();
    EXPECT_TRUE(std::equal(expected.block(0), expected.block(0) + bytes, reused.block(0)));
    EXPECT_TRUE(std::equal(expected.offsets(), expected.offsets() + expected.blocks() * 16, reused.offsets()));
  }
}

// Integer self-attention on (B, T, H * D) is, bit for bit, the integer products and softmax on the
// permuted heads (and so is the one taking Q, K, V side by side); with a padding mask, and sizes off every
// multiple the kernels block by.
TEST(Int8Attention, EqualsIntegerProductsAndSoftmaxOnPermutedHeads) {
  const int64_t batch = 3, t = 19, heads = 3, d = 10, width = heads * d;
  const ops::Int8AttentionScales scales{0.031f, 0.027f, 0.043f, 1.0f / 127};
  const double alpha = 1.0 / std::sqrt(double(d));
  Rng rng(51);
  auto random = [&](double spread) {
    std::vector<float> v(batch * t * width);
    for (auto& x : v) x = static_cast<float>(rng.next_normal() * spread);
    return Tensor<float>(Shape{batch, t, width}, v);
  };
  Tensor<float> q = random(2.0), k = random(2.0), v = random(3.0);
  std::vector<float> mask_values(batch * t, 0.0f);
  for (int64_t i = t - 5; i < t; ++i) mask_values[1 * t + i] = -10000.0f;  // sequence 1 padded
  Tensor<float> mask(Shape{batch, t}, mask_values);
  Graph<float> g;
  auto operands = [&] { return std::tuple{g.constant(q.view()), g.constant(k.view()), g.constant(v.view())}; };
  {
    auto [qv, kv, vv] = operands();
    EXPECT_THROW(ops::int8_attention(g, qv, kv, vv, g.constant(mask.view()), heads, scales, alpha),
                 std::exception);  // no gradient: inference only
  }
  NoGradGuard<float> no_grad(g);
  auto [qv, kv, vv] = operands();
  const Var mv = g.constant(mask.view());
  EXPECT_THROW(ops::int8_attention(g, qv, kv, vv, mv, 4, scales, alpha), std::exception);  // 30 channels, 4 heads
  EXPECT_THROW(
      ops::int8_attention(g, qv, kv, vv, g.constant(Tensor<float>(Shape{batch, t + 1}).view()), heads, scales, alpha),
      std::exception);
  const std::vector<float> fused = g.to_host(ops::int8_attention(g, qv, kv, vv, mv, heads, scales, alpha));

  auto split = [&](Var x) { return ops::permute(g, ops::reshape(g, x, Shape{batch, t, heads, d}), {0, 2, 1, 3}); };
  Var scores = ops::int8_matmul(g, split(qv), split(kv), scales.q, scales.k, alpha, true);
  Var probs = ops::softmax(g, scores, mv);
  Var context = ops::int8_matmul(g, probs, split(vv), scales.probs, scales.v, 1.0, false);
  const std::vector<float> composed =
      g.to_host(ops::reshape(g, ops::permute(g, context, {0, 2, 1, 3}), Shape{batch, t, width}));
  ASSERT_EQ(fused.size(), composed.size());
  for (size_t i = 0; i < fused.size(); ++i) ASSERT_EQ(fused[i], composed[i]) << "at " << i;
  // Q, K, V side by side in one tensor: the same bits.
  std::vector<float> packed(batch * t * 3 * width);
  for (int64_t row = 0; row < batch * t; ++row)
    for (int64_t i = 0; i < width; ++i) {
      packed[row * 3 * width + i] = q[row * width + i];
      packed[row * 3 * width + width + i] = k[row * width + i];
      packed[row * 3 * width + 2 * width + i] = v[row * width + i];
    }
  Tensor<float> qkv(Shape{batch, t, 3 * width}, packed);
  EXPECT_EQ(g.to_host(ops::int8_attention_packed(g, g.constant(qkv.view()), mv, heads, scales, alpha)), fused);
  EXPECT_THROW(ops::int8_attention_packed(g, qv, mv, heads, scales, alpha), std::exception);  // 10 per operand, 3 heads
  // Without a mask: the same as a mask of zeros.
  const std::vector<float> unmasked = g.to_host(ops::int8_attention(g, qv, kv, vv, Var{}, heads, scales, alpha));
  const std::vector<float> zeros = g.to_host(
      ops::int8_attention(g, qv, kv, vv, g.constant(Tensor<float>(Shape{batch, t}).view()), heads, scales, alpha));
  EXPECT_EQ(unmasked, zeros);
  EXPECT_NE(unmasked, fused);
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
                                           // tiles of 32 and 16 rows, the last 13 rows; pairs of blocks and one
                                           Int8Case{61, 33, 128}, Int8Case{48, 40, 64}, Int8Case{301, 768, 97},
                                           Int8Case{97, 1000, 768}));

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
  EXPECT_STREQ(int8_kernel_name(Int8Kernel::kAmx), "amx");
  // AMX, then VNNI, exactly where the AVX-512 set runs (not under BERT_CPU_KERNELS=build or avx2), then AVX2,
  // then plain C++.
  const bool avx512 = best_cpu_kernels() == CpuKernels::kAvx512;
  const Int8Kernel expected = avx512 && int8_kernel_supported(Int8Kernel::kAmx)          ? Int8Kernel::kAmx
                              : avx512 && int8_kernel_supported(Int8Kernel::kAvx512Vnni) ? Int8Kernel::kAvx512Vnni
                              : int8_kernel_supported(Int8Kernel::kAvx2)                 ? Int8Kernel::kAvx2
                                                                                         : Int8Kernel::kGeneric;
  EXPECT_EQ(best_int8_kernel(), expected);
}

}  // namespace
}  // namespace bert
