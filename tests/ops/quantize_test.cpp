// Fake quantization: exact QuantizeLinear/DequantizeLinear semantics (ties to even, saturation), the
// straight-through and LSQ gradients against finite differences (inputs off rounding and clamp edges).
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "core/rng.h"
#include "kernels/int8_gemm.h"

#include "ops/ops.h"
#include "tests/ops/gradcheck.h"

namespace bert {
namespace {

// ONNX QuantizeLinear (int8, zero point 0) then DequantizeLinear, written from the operator spec:
// y = saturate(round_half_to_even(x / s)) * s.
double quantize_dequantize_reference(double x, double s, int qmin, int qmax) {
  const double v = x / s;
  double r = std::floor(v);
  const double frac = v - r;
  if (frac > 0.5 || (frac == 0.5 && std::fmod(r, 2.0) != 0.0)) r += 1.0;  // half to even
  return std::min<double>(std::max<double>(r, qmin), qmax) * s;
}

Tensor<double> run(const std::vector<double>& xs, const std::vector<double>& scales, int qmin, int qmax,
                   int64_t* clipped = nullptr) {
  Tensor<double> x(Shape{static_cast<int64_t>(xs.size())}, xs), s(Shape{static_cast<int64_t>(scales.size())}, scales);
  Graph<double> g;
  TensorView<double> y =
      g.value(ops::fake_quantize(g, g.constant(x.view()), g.constant(s.view()), qmin, qmax, 1.0, clipped));
  Tensor<double> out(y.shape());
  out.view().copy_from(y);
  return out;
}

TEST(FakeQuantize, TiesRoundToEvenAndValuesSaturateLikeQuantizeLinear) {
  const double s = 0.1;
  // 2.5 s -> 2 s, -2.5 s -> -2 s, 3.5 s -> 4 s, -0.5 s -> 0, 200 s -> 127 s, -200 s -> -128 s.
  Tensor<double> y = run({2.5 * s, -2.5 * s, 3.5 * s, -0.5 * s, 200 * s, -200 * s, 0.26 * s}, {s}, -128, 127);
  const std::vector<double> expected = {2 * s, -2 * s, 4 * s, 0.0, 127 * s, -128 * s, 0.0};
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_DOUBLE_EQ(y[i], expected[i]) << i;
  // Narrow range (weights): -127 at the bottom.
  EXPECT_DOUBLE_EQ(run({-200 * s}, {s}, -127, 127)[0], -127 * s);
  // Against the reference over many values, float as in training.
  Rng rng(4);
  for (int i = 0; i < 20000; ++i) {
    const double x = 30 * rng.next_normal(), sc = 0.05 + rng.next_uniform();
    EXPECT_EQ(run({x}, {sc}, -128, 127)[0], quantize_dequantize_reference(x, sc, -128, 127)) << x << " / " << sc;
  }
  int64_t clipped = 3;  // counts are added
  run({0.0, 1000.0, -1000.0, 5.0}, {1.0}, -128, 127, &clipped);
  EXPECT_EQ(clipped, 5);
  // Counted exactly where backward stops the gradient: 127.25 rounds to 127 but lies beyond the range.
  clipped = 0;
  run({127.0, 127.25, -128.0, -128.25}, {1.0}, -128, 127, &clipped);
  EXPECT_EQ(clipped, 2);
}

TEST(FakeQuantize, PerChannelScalesApplyRowByRow) {
  // x (2, 3) with one scale per row; powers of two make the ties exact.
  Tensor<double> y = run({0.375, 0.75, 10.0, 0.375, 0.75, 10.0}, {0.25, 0.5}, -127, 127);
  EXPECT_DOUBLE_EQ(y[0], 0.5);   // 1.5 -> 2 (to even)
  EXPECT_DOUBLE_EQ(y[1], 0.75);  // 3
  EXPECT_DOUBLE_EQ(y[2], 10.0);  // 40
  EXPECT_DOUBLE_EQ(y[3], 0.5);   // 0.75 -> 1
  EXPECT_DOUBLE_EQ(y[4], 1.0);   // 1.5 -> 2 (to even)
  EXPECT_DOUBLE_EQ(y[5], 10.0);  // 20
  Graph<double> g;
  Tensor<double> x({2, 3}), bad(Shape{4}, {1, 1, 1, 1}), zero(Shape{1}, {0.0});
  EXPECT_THROW(ops::fake_quantize(g, g.constant(x.view()), g.constant(bad.view()), -128, 127), InternalError);
  EXPECT_THROW(ops::fake_quantize(g, g.constant(x.view()), g.constant(zero.view()), -128, 127), InternalError);
}

// Inputs whose x / s lies at least 0.1 away from a rounding boundary (k + 0.5) and from the clamp
// limits, so finite differences never cross a kink.
Tensor<double> off_kinks(Shape shape, const std::vector<double>& scales, int qmin, int qmax, uint64_t seed) {
  Tensor<double> x(shape);
  Rng rng(seed);
  const int64_t per = x.numel() / static_cast<int64_t>(scales.size());
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double s = scales[i / per];
    double v;
    do {
      v = (rng.next_uniform() * 2 - 1) * (qmax + 40);  // some inside, some beyond the range
    } while (std::abs(v - std::floor(v) - 0.5) < 0.1 || std::abs(v - qmin) < 0.6 || std::abs(v - qmax) < 0.6 ||
             std::abs(v - (qmin - 0.5)) < 0.6 || std::abs(v - (qmax + 0.5)) < 0.6);
    x[i] = v * s;
  }
  return x;
}

// The straight-through and LSQ gradients are, by definition, the exact derivatives of a surrogate in
// which rounding's residual is frozen at the evaluation point:
//   q~(x, s) = s * clamp(x / s + c, qmin, qmax),  c = round(x0 / s0) - x0 / s0.
// At (x0, s0) the surrogate equals the real forward; its central differences (in double, with inputs
// away from rounding and clamp edges) must match the op's backward for x and for s.
TEST(FakeQuantize, StraightThroughAndLsqScaleGradientsMatchFiniteDifferencesOfTheSurrogate) {
  struct Case {
    Shape shape;
    std::vector<double> scales;
    int qmin, qmax;
    double grad_scale;
  };
  for (const Case& k : {Case{{40}, {0.1}, -128, 127, 1.0}, Case{{3, 16}, {0.05, 0.2, 1.5}, -127, 127, 0.25},
                        Case{{2, 5, 4}, {0.3}, -8, 7, 1.0 / std::sqrt(20.0 * 7)}}) {
    SCOPED_TRACE(k.shape.str());
    Tensor<double> x = off_kinks(k.shape, k.scales, k.qmin, k.qmax, 5);
    Tensor<double> s(Shape{static_cast<int64_t>(k.scales.size())}, k.scales);
    const int64_t n = x.numel(), per = n / s.numel();
    Tensor<double> projection = testing::random_tensor(k.shape, 17);
    std::vector<double> residual(n);  // c, frozen at the base point
    for (int64_t i = 0; i < n; ++i) residual[i] = std::nearbyint(x[i] / s[i / per]) - x[i] / s[i / per];
    // L~ = sum R * q~(x, s), the surrogate written out independently of the op.
    auto surrogate_loss = [&](const Tensor<double>& xv, const Tensor<double>& sv) {
      double loss = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double sc = sv[i / per];
        loss += projection[i] * sc * std::min<double>(std::max<double>(xv[i] / sc + residual[i], k.qmin), k.qmax);
      }
      return loss;
    };
    // The op: forward equal to the surrogate at the base point; backward from L = sum R * q(x, s).
    Tensor<double> gx(x.shape()), gs(s.shape());
    Graph<double> g;
    Var y = ops::fake_quantize(g, g.leaf(x.view(), gx.view()), g.leaf(s.view(), gs.view()), k.qmin, k.qmax, 1.0);
    double op_loss = 0;
    for (int64_t i = 0; i < n; ++i) op_loss += projection[i] * g.value(y)[i];
    EXPECT_NEAR(op_loss, surrogate_loss(x, s), 1e-9);
    g.backward(ops::sum(g, ops::mul(g, y, g.constant(projection.view()))));

    const double h = 1e-7;  // far below the 0.1 * s distance to any kink
    for (int64_t i = 0; i < n; ++i) {
      const double saved = x[i];
      x[i] = saved + h;
      const double plus = surrogate_loss(x, s);
      x[i] = saved - h;
      const double minus = surrogate_loss(x, s);
      x[i] = saved;
      EXPECT_NEAR(gx[i], (plus - minus) / (2 * h), 1e-6) << "dx " << i;
    }
    for (int64_t c = 0; c < s.numel(); ++c) {
      const double saved = s[c];
      s[c] = saved + h;
      const double plus = surrogate_loss(x, s);
      s[c] = saved - h;
      const double minus = surrogate_loss(x, s);
      s[c] = saved;
      const double numeric = (plus - minus) / (2 * h);
      EXPECT_NEAR(gs[c], numeric, 1e-6 * (1 + std::abs(numeric))) << "ds " << c;
    }
    // The gradient scale multiplies the scale gradient only.
    Tensor<double> gx2(x.shape()), gs2(s.shape());
    Graph<double> g2;
    Var y2 = ops::fake_quantize(g2, g2.leaf(x.view(), gx2.view()), g2.leaf(s.view(), gs2.view()), k.qmin, k.qmax,
                                k.grad_scale);
    g2.backward(ops::sum(g2, ops::mul(g2, y2, g2.constant(projection.view()))));
    for (int64_t c = 0; c < s.numel(); ++c) EXPECT_NEAR(gs2[c], k.grad_scale * gs[c], 1e-12 * (1 + std::abs(gs[c])));
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(gx2[i], gx[i]);
  }
}

TEST(FakeQuantize, ScaleGradientIsTheGradScaleTimesTheLsqSum) {
  // One element inside (x/s = 2.3 -> round 2: 2 - 2.3 = -0.3), one above (qmax), one below (qmin).
  Tensor<double> x(Shape{3}, {0.23, 50.0, -50.0}), s(Shape{1}, {0.1}), gx({3}), gs({1});
  Graph<double> g;
  Var y = ops::fake_quantize(g, g.leaf(x.view(), gx.view()), g.leaf(s.view(), gs.view()), -128, 127, 0.5);
  g.backward(ops::sum(g, y));
  EXPECT_NEAR(gs[0], 0.5 * (-0.3 + 127 - 128), 1e-12);
  EXPECT_EQ(gx[0], 1.0);
  EXPECT_EQ(gx[1], 0.0);
  EXPECT_EQ(gx[2], 0.0);
}

// The fake-quantized linear with exact sums (CPU inference): the integer engine's values bit for bit (linear and
// linear + GELU; per-channel weight scales, bias, odd sizes, inputs clamped at both ends, inputs that were not
// fake-quantized first), and the plain linear of the same fake-quantized operands up to float summation order.
// Odd sizes, and products deeper than 1024 inputs (BERT-base's second FFN linear has 3,072) whose first row
// and channel sum past 2^24: FP32 summation in one chain would round there, the slices added in int32 do
// not. At 2,500 inputs the GEMM kernels' own partial sums still stay below 2^24 (split over vector lanes);
// at 40,000 they do not, and one GEMM over the whole depth fails this test.
class ExactQuantizedLinear : public ::testing::TestWithParam<std::array<int64_t, 3>> {};

TEST_P(ExactQuantizedLinear, EqualsTheIntegerEngineBitForBitAndTheFloatLinearUpToRounding) {
  const auto [rows, k, n] = GetParam();
  Rng rng(17);
  const float scale_x = 0.043f;
  std::vector<float> x(rows * k), w(n * k), scale_w(n), bias(n);
  for (auto& v : x) v = static_cast<float>(rng.next_normal() * 2.0);
  x[0] = 50.0f, x[1] = -50.0f;  // beyond the range: clamped to 127 and -128 steps
  for (auto& v : w) v = static_cast<float>(rng.next_normal() * 0.05);
  for (auto& v : bias) v = static_cast<float>(rng.next_normal());
  if (k > 1024) {  // row 0 at the top of the range, channel 0 positive: its sum passes 2^24
    for (int64_t i = 0; i < k; ++i) x[i] = 50.0f, w[i] = 0.05f + 0.2f * std::abs(w[i]);
  }
  std::vector<int8_t> q_w(n * k);
  for (int64_t c = 0; c < n; ++c) {
    float largest = 0;
    for (int64_t i = 0; i < k; ++i) largest = std::max(largest, std::abs(w[c * k + i]));
    scale_w[c] = largest / 127.0f;
    for (int64_t i = 0; i < k; ++i)
      q_w[c * k + i] = static_cast<int8_t>(std::clamp(std::nearbyint(w[c * k + i] / scale_w[c]), -127.0f, 127.0f));
  }
  if (k > 1024) {  // the deep row's exact sum, and that a float sum in order would have rounded it
    int64_t exact = 0;
    float in_order = 0;
    for (int64_t i = 0; i < k; ++i) exact += 127 * int64_t{q_w[i]}, in_order += 127.0f * q_w[i];
    ASSERT_GT(exact, int64_t{1} << 24);
    ASSERT_NE(in_order, static_cast<float>(exact));
  }
  const Int8Weights packed(q_w.data(), n, k);
  Tensor<float> tx(Shape{rows, k}, x), tw(Shape{n, k}, w), tb(Shape{n}, bias), sx(Shape{1}, {scale_x}),
      sw(Shape{n}, scale_w);
  for (bool prequantized : {true, false}) {
    for (bool gelu : {false, true}) {
      SCOPED_TRACE(std::string(prequantized ? "fake-quantized x" : "raw x") + (gelu ? ", gelu" : ""));
      Graph<float> g;
      NoGradGuard<float> no_grad(g);
      Var xv = g.constant(tx.view());
      if (prequantized) xv = ops::fake_quantize(g, xv, g.constant(sx.view()), -128, 127, 1.0);
      const Var wq = ops::fake_quantize(g, g.constant(tw.view()), g.constant(sw.view()), -127, 127, 1.0);
      const Var b = g.constant(tb.view());
      const std::vector<float> exact = g.to_host(ops::exact_quantized_linear(g, xv, scale_x, wq, scale_w, b, gelu));
      const std::vector<float> engine = g.to_host(gelu ? ops::int8_linear_gelu(g, xv, packed, scale_x, scale_w, b)
                                                       : ops::int8_linear(g, xv, packed, scale_x, scale_w, b));
      ASSERT_EQ(exact, engine);
      const Var xq = prequantized ? xv : ops::fake_quantize(g, xv, g.constant(sx.view()), -128, 127, 1.0);
      const std::vector<float> plain = g.to_host(gelu ? ops::linear_gelu(g, xq, wq, b) : ops::linear(g, xq, wq, b));
      double largest = 0, diff = 0;
      for (size_t i = 0; i < plain.size(); ++i) {
        largest = std::max(largest, std::abs(double(plain[i])));
        diff = std::max(diff, std::abs(double(plain[i]) - exact[i]));
      }
      EXPECT_GT(diff, 0.0);  // float summation does differ somewhere: the test would notice the exact sums missing
      EXPECT_LE(diff, 1e-5 * largest);
    }
  }
  Graph<float> g;
  const Var xv = g.constant(tx.view()), wv = g.constant(tw.view());
  EXPECT_THROW(ops::exact_quantized_linear(g, xv, scale_x, wv, scale_w, Var{}), std::exception);  // gradients on
  NoGradGuard<float> no_grad(g);
  EXPECT_THROW(ops::exact_quantized_linear(g, xv, scale_x, wv, std::span<const float>(scale_w).first(3), Var{}),
               std::exception);  // one scale per output
  EXPECT_THROW(ops::exact_quantized_linear(g, g.constant(tw.view()), scale_x, xv, scale_w, Var{}), std::exception);
}

INSTANTIATE_TEST_SUITE_P(Sizes, ExactQuantizedLinear,
                         ::testing::Values(std::array<int64_t, 3>{37, 203, 45}, std::array<int64_t, 3>{9, 2500, 21},
                                           std::array<int64_t, 3>{5, 40000, 7}));

}  // namespace
}  // namespace bert

namespace bert {
namespace {

// A per-tensor scale over several work blocks: the result and the scale gradient do not depend on the
// number of threads (blocks are fixed-size, partial sums added in block order).
TEST(FakeQuantize, LargePerTensorInputGivesIdenticalResultsOnOneAndTwoThreads) {
  auto run_with = [](int threads) {
    omp_set_num_threads(threads);
    Tensor<float> x = testing::to_float(testing::random_tensor({5, 40000}, 31, 3.0));
    Tensor<float> s(Shape{1}, {0.05f}), gx(x.shape()), gs({1});
    Graph<float> g;
    Var y = ops::fake_quantize(g, g.leaf(x.view(), gx.view()), g.leaf(s.view(), gs.view()), -128, 127, 0.01);
    std::vector<float> out(g.value(y).begin(), g.value(y).end());
    g.backward(ops::sum(g, y));
    out.push_back(gs[0]);
    out.insert(out.end(), gx.data(), gx.data() + 100);
    return out;
  };
  const int saved = omp_get_max_threads();
  const std::vector<float> one = run_with(1), two = run_with(2);
  omp_set_num_threads(saved);
  EXPECT_EQ(one, two);
}

// An inner input's gradient is stored into a fresh buffer (here over NaN), a leaf's is added: both give
// the same gradients, and the float scale gradient (summed in lanes, the lanes in double) matches a
// double-precision sum of the LSQ terms.
TEST(FakeQuantize, InnerInputGetsTheLeafsGradientsAndTheScaleSumIsAccurate) {
  const Tensor<float> x = testing::to_float(testing::random_tensor({5, 40000}, 41, 3.0));
  Tensor<float> projection = testing::to_float(testing::random_tensor({5, 40000}, 42));
  const float scale = 0.05f, grad_scale = 0.01f;
  auto run = [&](bool inner, Tensor<float>& gx) {
    Tensor<float> xv = x.clone(), s(Shape{1}, {scale}), gs({1});
    Graph<float> g;
    float* poison = g.scratch<float>(size_t{4} << 20);
    std::fill(poison, poison + (size_t{4} << 20), std::numeric_limits<float>::quiet_NaN());
    g.clear();
    Var input = g.leaf(xv.view(), gx.view());
    if (inner) input = ops::scale(g, input, 1.0);
    Var y = ops::fake_quantize(g, input, g.leaf(s.view(), gs.view()), -128, 127, grad_scale);
    g.backward(ops::sum(g, ops::mul(g, y, g.constant(projection.view()))));
    return gs[0];
  };
  Tensor<float> gx_leaf(x.shape()), gx_inner(x.shape());
  const float ds_leaf = run(false, gx_leaf), ds_inner = run(true, gx_inner);
  EXPECT_EQ(ds_leaf, ds_inner);
  for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(gx_leaf[i], gx_inner[i]) << i;
  double reference = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float v = x[i] / scale;
    reference += double(projection[i]) * (v < -128 ? -128.0 : v > 127 ? 127.0 : double(std::nearbyint(v) - v));
  }
  EXPECT_NEAR(ds_leaf, grad_scale * reference, 1e-5 * std::abs(grad_scale * reference));
}

// A residual LayerNorm read only by quantizers (dropout_add_layer_norm_each): on the CPU the ops in sequence,
// dropout_add_layer_norm (with the add's input quantizer) then fake_quantize_each, with the same draws: the
// same outputs and gradients (addends, gamma, beta, every scale) bit for bit. (The GPU's one kernel each way is
// held to the same ops in CudaOps.DropoutAddLayerNormEachEqualsTheOpsInSequence.)
TEST(DropoutAddLayerNormEach, IsTheOpsInSequenceOnTheCpu) {
  const Shape shape{6, 24};
  const Tensor<float> a = testing::to_float(testing::random_tensor({6, 24}, 51, 1.0));
  const Tensor<float> b = testing::to_float(testing::random_tensor({6, 24}, 52, 1.0));
  const Tensor<float> gamma = testing::to_float(testing::random_tensor({24}, 53, 0.5));
  const Tensor<float> beta = testing::to_float(testing::random_tensor({24}, 54, 0.5));
  Tensor<float> up0 = testing::to_float(testing::random_tensor({6, 24}, 55));
  Tensor<float> up1 = testing::to_float(testing::random_tensor({6, 24}, 56));
  struct Run {
    std::vector<float> y0, y1, grads;
    int64_t clipped[3] = {0, 0, 0};
  };
  auto run = [&](bool fused) {
    Tensor<float> av = a.clone(), bv = b.clone(), gv = gamma.clone(), tv = beta.clone();
    for (int64_t i = 0; i < gv.numel(); ++i) gv[i] += 1.0f;
    Tensor<float> ga(shape), gb(shape), gg({24}), gt({24});
    // Small enough that each quantizer saturates some elements (|a| and |y| up to about 1 and 3).
    std::array<Tensor<float>, 3> scales = {Tensor<float>(Shape{1}, {0.005f}), Tensor<float>(Shape{1}, {0.012f}),
                                           Tensor<float>(Shape{1}, {0.015f})};
    std::array<Tensor<float>, 3> gs = {Tensor<float>({1}), Tensor<float>({1}), Tensor<float>({1})};
    Run r;
    Graph<float> g;
    std::vector<ops::QuantizeOutput> q;
    for (int i = 0; i < 3; ++i)
      q.push_back({g.leaf(scales[i].view(), gs[i].view()), -128, 127, 0.3 + 0.1 * i, &r.clipped[i]});
    const Var ain = g.leaf(av.view(), ga.view()), bin = g.leaf(bv.view(), gb.view());
    const Var gamma_in = g.leaf(gv.view(), gg.view()), beta_in = g.leaf(tv.view(), gt.view());
    const std::span<const ops::QuantizeOutput> outputs(q.data() + 1, 2);
    Rng rng(17);
    std::vector<Var> ys;
    if (fused) {
      ys = ops::dropout_add_layer_norm_each(g, ain, bin, gamma_in, beta_in, 1e-12, 0.1, true, rng, &q[0], outputs);
    } else {
      const Var y = ops::dropout_add_layer_norm(g, ain, bin, gamma_in, beta_in, 1e-12, 0.1, true, rng, q[0]);
      ys = ops::fake_quantize_each(g, y, outputs);
    }
    const TensorView<float> y0 = g.value(ys[0]), y1 = g.value(ys[1]);
    r.y0.assign(y0.data(), y0.data() + y0.numel());
    r.y1.assign(y1.data(), y1.data() + y1.numel());
    g.backward(ops::add(g, ops::sum(g, ops::mul(g, ys[0], g.constant(up0.view()))),
                        ops::sum(g, ops::mul(g, ys[1], g.constant(up1.view())))));
    for (const Tensor<float>* t : {&ga, &gb, &gg, &gt, &gs[0], &gs[1], &gs[2]})
      for (int64_t i = 0; i < t->numel(); ++i) r.grads.push_back((*t)[i]);
    return r;
  };
  const Run fused = run(true), separate = run(false);
  EXPECT_EQ(fused.y0, separate.y0);
  EXPECT_EQ(fused.y1, separate.y1);
  EXPECT_EQ(fused.grads, separate.grads);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(fused.clipped[i], separate.clipped[i]) << "quantizer " << i;
    EXPECT_GT(fused.clipped[i], 0) << "quantizer " << i << " saturates some elements";
  }
}

}  // namespace
}  // namespace bert
