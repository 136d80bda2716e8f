// Every primitive op: forward against a plain reference loop, backward against central finite
// differences in double precision, at several shapes.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/gemm.h"
#include "ops/ops.h"
#include "tests/ops/gradcheck.h"

namespace bert {
namespace {

using testing::expect_gradients_match;
using testing::GradCheckOptions;
using testing::random_tensor;
using Leaves = std::vector<Var>;

// random_tensor's values rounded to float: inputs of the tests that compare fused float ops bit for bit.
Tensor<float> random_floats(Shape shape, uint64_t seed, double scale = 1.0) {
  const Tensor<double> d = random_tensor(shape, seed, scale);
  Tensor<float> f(shape);
  for (int64_t i = 0; i < d.numel(); ++i) f[i] = static_cast<float>(d[i]);
  return f;
}

// Forward tolerance of the double-precision op against its double reference loop.
constexpr double kForwardTolerance = 1e-12;

// Runs `build` on constant inputs (no gradients) and returns a copy of the output.
Tensor<double> run_forward(std::vector<Tensor<double>>& inputs, const testing::BuildFn& build) {
  Graph<double> g;
  Leaves leaves;
  for (auto& t : inputs) leaves.push_back(g.constant(t.view()));
  TensorView<double> out = g.value(build(g, leaves));
  Tensor<double> copy(out.shape());
  copy.view().copy_from(out);
  return copy;
}

void expect_tensors_near(const Tensor<double>& actual, const Tensor<double>& expected, double tol) {
  ASSERT_EQ(actual.shape(), expected.shape());
  for (int64_t i = 0; i < actual.numel(); ++i) EXPECT_NEAR(actual[i], expected[i], tol) << "element " << i;
}

// Multi-index helpers for the references, independent of the ops' own index arithmetic.
std::vector<int64_t> unravel(int64_t flat, const Shape& s) {
  std::vector<int64_t> idx(s.rank());
  for (int d = s.rank() - 1; d >= 0; --d) {
    idx[d] = flat % s[d];
    flat /= s[d];
  }
  return idx;
}
int64_t ravel(const std::vector<int64_t>& idx, const Shape& s) {
  int64_t flat = 0;
  for (int d = 0; d < s.rank(); ++d) flat = flat * s[d] + idx[d];
  return flat;
}

// ---------------------------------------------------------------- matmul

double matrix_at(const Tensor<double>& t, int64_t batch, int64_t r, int64_t c, bool trans) {
  const int64_t rows = t.shape()[-2], cols = t.shape()[-1];
  return trans ? t[batch * rows * cols + c * cols + r] : t[batch * rows * cols + r * cols + c];
}

Tensor<double> matmul_reference(const Tensor<double>& a, const Tensor<double>& b, bool ta, bool tb) {
  const Shape& as = a.shape();
  const Shape& bs = b.shape();
  const int64_t m = ta ? as[-1] : as[-2], k = ta ? as[-2] : as[-1], n = tb ? bs[-2] : bs[-1];
  const int64_t batch = as.numel() / (as[-1] * as[-2]);
  Shape out = as;
  out[-2] = m;
  out[-1] = n;
  Tensor<double> c(out);
  for (int64_t bi = 0; bi < batch; ++bi)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t p = 0; p < k; ++p) acc += matrix_at(a, bi, i, p, ta) * matrix_at(b, bi, p, j, tb);
        c[bi * m * n + i * n + j] = acc;
      }
  return c;
}

struct MatmulCase {
  Shape a, b;
  bool trans_a, trans_b;
};

class MatmulTest : public ::testing::TestWithParam<MatmulCase> {};

TEST_P(MatmulTest, ForwardMatchesReferenceAndGradientsMatchFiniteDifferences) {
  const MatmulCase c = GetParam();
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor(c.a, 1));
  in.push_back(random_tensor(c.b, 2));
  auto build = [&](Graph<double>& g, const Leaves& x) { return ops::matmul(g, x[0], x[1], c.trans_a, c.trans_b); };
  expect_tensors_near(run_forward(in, build), matmul_reference(in[0], in[1], c.trans_a, c.trans_b), kForwardTolerance);
  expect_gradients_match(in, build);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MatmulTest,
    ::testing::Values(MatmulCase{{3, 4}, {4, 5}, false, false}, MatmulCase{{4, 3}, {4, 5}, true, false},
                      MatmulCase{{3, 4}, {5, 4}, false, true}, MatmulCase{{4, 3}, {5, 4}, true, true},
                      MatmulCase{{1, 7}, {7, 1}, false, false}, MatmulCase{{2, 3, 4, 5}, {2, 3, 5, 2}, false, false},
                      MatmulCase{{2, 3, 5, 4}, {2, 3, 2, 5}, true, true},
                      MatmulCase{{3, 4, 6}, {3, 4, 6}, false, true},     // Q K^T
                      MatmulCase{{3, 4, 4}, {3, 4, 6}, false, false}));  // P V

TEST(Matmul, SharedRightOperandFoldsLeadingAxes) {
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({2, 3, 4}, 3));
  in.push_back(random_tensor({4, 5}, 4));
  auto build = [](Graph<double>& g, const Leaves& x) { return ops::matmul(g, x[0], x[1]); };
  Tensor<double> out = run_forward(in, build);
  ASSERT_EQ(out.shape(), Shape({2, 3, 5}));
  Tensor<double> a2 = in[0].clone();
  Tensor<double> flat(Shape{6, 4}, std::vector<double>(a2.data(), a2.data() + 24));
  Tensor<double> expected = matmul_reference(flat, in[1], false, false);
  for (int64_t i = 0; i < out.numel(); ++i) EXPECT_NEAR(out[i], expected[i], kForwardTolerance);
  expect_gradients_match(in, build);
}

TEST(Matmul, ScaledMatmulIsTheScaledProduct) {
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({2, 3, 4, 5}, 5));
  in.push_back(random_tensor({2, 3, 6, 5}, 6));
  auto build = [](Graph<double>& g, const Leaves& x) { return ops::scaled_matmul(g, x[0], x[1], 0.125, false, true); };
  Tensor<double> out = run_forward(in, build);
  Tensor<double> plain =
      run_forward(in, [](Graph<double>& g, const Leaves& x) { return ops::matmul(g, x[0], x[1], false, true); });
  ASSERT_EQ(out.shape(), plain.shape());
  for (int64_t i = 0; i < out.numel(); ++i) EXPECT_NEAR(out[i], 0.125 * plain[i], kForwardTolerance);
  expect_gradients_match(in, build);
}

TEST(Matmul, RejectsMismatchedShapes) {
  Graph<double> g;
  Tensor<double> a({3, 4}), b({5, 6});
  EXPECT_THROW(ops::matmul(g, g.constant(a.view()), g.constant(b.view())), InternalError);
}

// ---------------------------------------------------------------- linear

Tensor<double> linear_reference(const Tensor<double>& x, const Tensor<double>& w, const Tensor<double>* b) {
  const int64_t in = w.shape()[1], out = w.shape()[0], rows = x.numel() / in;
  Tensor<double> y(x.shape().with_last(out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b ? (*b)[o] : 0.0;
      for (int64_t i = 0; i < in; ++i) acc += x[r * in + i] * w[o * in + i];
      y[r * out + o] = acc;
    }
  return y;
}

TEST(Linear, WithAndWithoutBiasAtSeveralShapes) {
  for (Shape xs : {Shape{5, 4}, Shape{2, 3, 4}, Shape{2, 2, 3, 4}}) {
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE(xs.str() + (with_bias ? " with bias" : " without bias"));
      std::vector<Tensor<double>> in;
      in.push_back(random_tensor(xs, 5));
      in.push_back(random_tensor({3, 4}, 6));
      in.push_back(random_tensor({3}, 7));
      auto build = [&](Graph<double>& g, const Leaves& x) {
        return ops::linear(g, x[0], x[1], with_bias ? x[2] : Var{});
      };
      expect_tensors_near(run_forward(in, build), linear_reference(in[0], in[1], with_bias ? &in[2] : nullptr),
                          kForwardTolerance);
      expect_gradients_match(in, build);
    }
  }
}

// gelu(linear(x, W, b)) with the GELU in the GEMM's finish: the exact erf form of a reference loop, and
// finite differences through both the product and the GELU.
TEST(LinearGelu, MatchesReferenceAndFiniteDifferences) {
  for (Shape xs : {Shape{5, 4}, Shape{2, 3, 4}}) {
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE(xs.str() + (with_bias ? " with bias" : " without bias"));
      std::vector<Tensor<double>> in;
      in.push_back(random_tensor(xs, 15));
      in.push_back(random_tensor({3, 4}, 16));
      in.push_back(random_tensor({3}, 17));
      auto build = [&](Graph<double>& g, const Leaves& x) {
        return ops::linear_gelu(g, x[0], x[1], with_bias ? x[2] : Var{});
      };
      Tensor<double> expected = linear_reference(in[0], in[1], with_bias ? &in[2] : nullptr);
      for (int64_t i = 0; i < expected.numel(); ++i)
        expected[i] = 0.5 * expected[i] * (1.0 + std::erf(expected[i] / std::sqrt(2.0)));
      expect_tensors_near(run_forward(in, build), expected, kForwardTolerance);
      expect_gradients_match(in, build);
    }
  }
}

// The feed-forward block linear(gelu(linear(x, W1, b1)), W2, b2): a reference loop's values, finite
// differences through both products and the GELU (on the CPU the op is those three; the GPU's own is held to
// them by CudaOps.FeedForwardIsLinearGeluLinear).
TEST(FeedForward, MatchesReferenceAndFiniteDifferences) {
  for (Shape xs : {Shape{5, 4}, Shape{2, 3, 4}}) {
    SCOPED_TRACE(xs.str());
    std::vector<Tensor<double>> in;
    in.push_back(random_tensor(xs, 25));
    in.push_back(random_tensor({6, 4}, 26));
    in.push_back(random_tensor({6}, 27));
    in.push_back(random_tensor({3, 6}, 28));
    in.push_back(random_tensor({3}, 29));
    auto build = [](Graph<double>& g, const Leaves& x) { return ops::feed_forward(g, x[0], x[1], x[2], x[3], x[4]); };
    Tensor<double> hidden = linear_reference(in[0], in[1], &in[2]);
    for (int64_t i = 0; i < hidden.numel(); ++i)
      hidden[i] = 0.5 * hidden[i] * (1.0 + std::erf(hidden[i] / std::sqrt(2.0)));
    expect_tensors_near(run_forward(in, build), linear_reference(hidden, in[3], &in[4]), kForwardTolerance);
    expect_gradients_match(in, build);
  }
}

// Activation checkpointing, fn = a product, softmax, dropout, a product (the attention's core) on the
// graph's sub-graph: finite differences through the recomputed backward (the same draws each pass); against
// fn on the graph itself the same bits forward and backward, inputs that are leaves and inner nodes, a
// gradient written fresh and one added to, the same rng state after; the graph keeps fn's output only.
TEST(Recompute, GivesFnsValuesAndGradientsKeepingOnlyItsOutput) {
  const auto fn = [](auto& g, std::span<const Var> in, Rng& rng) {
    const Var scores = ops::matmul(g, in[0], in[1], false, true);
    return ops::matmul(g, ops::dropout(g, ops::softmax(g, scores), 0.25, true, rng), in[2]);
  };
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({5, 4}, 51));
  in.push_back(random_tensor({6, 4}, 52));
  in.push_back(random_tensor({6, 3}, 53));
  expect_gradients_match(in, [&](Graph<double>& g, const Leaves& x) {
    Rng rng(7);
    return ops::recompute<double>(g, x, rng, fn);
  });

  struct Run {
    std::vector<float> y, da, db, dc;
    uint64_t counter = 0;
    size_t kept = 0;
  };
  Tensor<float> a = testing::to_float(in[0]), b = testing::to_float(in[1]), c = testing::to_float(in[2]);
  Tensor<float> c5 = testing::to_float(random_tensor({5, 3}, 55)), r = testing::to_float(random_tensor({5, 3}, 54));
  // q = a / 2 (an inner node) and its gradient: fresh when only fn reads q, added to when q is read again
  // after fn (that reader's backward runs first); q also given twice (fn's scores q q^T: two sub-graph
  // leaves on one gradient buffer).
  enum class Q { kFresh, kAddedTo, kTwice };
  auto run = [&](bool recomputed, Q use) {
    Run out;
    Tensor<float> ga({5, 4}), gb({6, 4}), gc({6, 3}), gc5({5, 3});
    Graph<float> g;
    {  // NaN in the workspace: a fresh gradient added to instead of stored would show
      constexpr size_t kPoisoned = size_t{1} << 16;
      float* poison = g.scratch<float>(kPoisoned);
      std::fill(poison, poison + kPoisoned, std::numeric_limits<float>::quiet_NaN());
      g.clear();
    }
    Rng rng(11);
    const Var av = g.leaf(a.view(), ga.view()), bv = g.leaf(b.view(), gb.view());
    const Var cv = use == Q::kTwice ? g.leaf(c5.view(), gc5.view()) : g.leaf(c.view(), gc.view());
    const Var q = ops::scale(g, av, 0.5);
    const std::vector<Var> inputs = {q, use == Q::kTwice ? q : bv, cv};
    const size_t before = g.workspace().bytes_in_use();
    const Var y = recomputed ? ops::recompute<float>(g, inputs, rng, fn) : fn(g, inputs, rng);
    out.kept = g.workspace().bytes_in_use() - before;
    out.counter = rng.state().counter;
    out.y.assign(g.value(y).data(), g.value(y).data() + 15);
    Var loss = ops::sum(g, ops::mul(g, y, g.constant(r.view())));
    if (use == Q::kAddedTo) loss = ops::add(g, loss, ops::sum(g, ops::mul(g, q, q)));
    g.backward(loss);
    out.da.assign(ga.data(), ga.data() + ga.numel());
    out.db.assign(gb.data(), gb.data() + gb.numel());
    out.dc = use == Q::kTwice ? std::vector<float>(gc5.data(), gc5.data() + gc5.numel())
                              : std::vector<float>(gc.data(), gc.data() + gc.numel());
    return out;
  };
  Run direct;
  for (const Q use : {Q::kFresh, Q::kAddedTo, Q::kTwice}) {
    SCOPED_TRACE(use == Q::kFresh ? "q's gradient fresh" : use == Q::kAddedTo ? "added to" : "q twice");
    const Run plain = run(false, use), recomputed = run(true, use);
    EXPECT_EQ(recomputed.y, plain.y);
    EXPECT_EQ(recomputed.da, plain.da);
    EXPECT_EQ(recomputed.db, plain.db);
    EXPECT_EQ(recomputed.dc, plain.dc);
    for (const float v : recomputed.da) EXPECT_TRUE(std::isfinite(v));
    EXPECT_EQ(recomputed.counter, plain.counter);
    EXPECT_GT(recomputed.counter, 0u);
    constexpr size_t kAlign = Workspace::kAlignment;
    EXPECT_EQ(recomputed.kept, (15 * sizeof(float) + kAlign - 1) / kAlign * kAlign);  // y alone
    EXPECT_GT(plain.kept, 4 * recomputed.kept);
    if (use == Q::kFresh) direct = plain;
  }

  Graph<float> g;  // without gradients: fn on the graph itself
  NoGradGuard<float> no_grad(g);
  Rng rng(11);
  const std::vector<Var> inputs = {ops::scale(g, g.constant(a.view()), 0.5), g.constant(b.view()),
                                   g.constant(c.view())};
  const Var y = ops::recompute<float>(g, inputs, rng, fn);
  EXPECT_EQ(std::vector<float>(g.value(y).data(), g.value(y).data() + 15), direct.y);
  EXPECT_EQ(g.sub_graph().num_nodes(), 0u);
}

// In float at a size the GEMM threads (blocks of C finished on several threads): the same bits as the two
// ops, forward with and without gradients, and the same gradients.
TEST(LinearGelu, SameBitsAsGeluOfLinearWithAndWithoutGradients) {
  const int saved = omp_get_max_threads();
  for (int threads : {1, 3}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    omp_set_num_threads(threads);
    Tensor<float> x = random_floats({2, 150, 96}, 31), w = random_floats({200, 96}, 32), b = random_floats({200}, 33);
    Tensor<float> r = random_floats({2, 150, 200}, 34);  // weights of the loss: every output gets its own gradient
    struct Run {
      std::vector<float> y, dx, dw, db;
    };
    auto run = [&](bool fused, bool gradients) {
      Run out;
      Tensor<float> gx(x.shape()), gw(w.shape()), gb(b.shape());
      for (Tensor<float>* t : {&gx, &gw, &gb}) t->view().fill(0.0f);
      Graph<float> g;
      g.set_grad_enabled(gradients);
      Var xv = g.leaf(x.view(), gx.view()), wv = g.leaf(w.view(), gw.view()), bv = g.leaf(b.view(), gb.view());
      Var y = fused ? ops::linear_gelu(g, xv, wv, bv) : ops::gelu(g, ops::linear(g, xv, wv, bv));
      TensorView<float> yv = g.value(y);
      out.y.assign(yv.data(), yv.data() + yv.numel());
      if (gradients) {
        g.backward(ops::sum(g, ops::mul(g, y, g.constant(r.view()))));
        out.dx.assign(gx.data(), gx.data() + gx.numel());
        out.dw.assign(gw.data(), gw.data() + gw.numel());
        out.db.assign(gb.data(), gb.data() + gb.numel());
      }
      return out;
    };
    const Run two_ops = run(false, true), fused = run(true, true), inference = run(true, false);
    EXPECT_EQ(fused.y, two_ops.y);
    EXPECT_EQ(inference.y, two_ops.y);
    EXPECT_EQ(fused.dx, two_ops.dx);
    EXPECT_EQ(fused.dw, two_ops.dw);
    EXPECT_EQ(fused.db, two_ops.db);
  }
  omp_set_num_threads(saved);
}

// A CPU device in BF16 precision: every product of linear, linear_gelu and matmul, forward and both
// gradients, takes BF16-rounded operands and sums in FP32, each the reference product on rounded operands;
// every tensor stays FP32 (the inputs are left as they were).
TEST(Bf16Products, LinearAndMatmulRoundTheirOperandsForwardAndBackward) {
  const std::unique_ptr<Device> cpu_bf16 = Device::open("cpu", Precision::kBf16);
  const int64_t rows = 150, in = 96, out = 200;
  Tensor<float> x = random_floats({rows, in}, 41), w = random_floats({out, in}, 42), r = random_floats({rows, out}, 43);
  const std::vector<float> x_saved(x.data(), x.data() + x.numel());
  auto near_reference = [](std::span<const float> actual, GemmArgs args, const float* a, int64_t lda, const float* b,
                           int64_t ldb, const std::string& what) {
    std::vector<float> expected(actual.size()), fp32(actual.size());
    gemm_reference<float>(args, 1.0f, a, lda, b, ldb, 0.0f, expected.data(), args.n);
    args.bf16 = false;
    gemm_reference<float>(args, 1.0f, a, lda, b, ldb, 0.0f, fp32.data(), args.n);
    double diff = 0, from_fp32 = 0;
    for (size_t i = 0; i < actual.size(); ++i) {
      diff = std::max(diff, std::abs(double(actual[i]) - expected[i]));
      from_fp32 = std::max(from_fp32, std::abs(double(actual[i]) - fp32[i]));
    }
    EXPECT_LT(diff, 1e-5 * (1 + std::sqrt(double(args.k)))) << what;
    EXPECT_GT(from_fp32, 1e-3) << what << ": the operands were not rounded";
  };
  for (bool fused_gelu : {false, true}) {
    SCOPED_TRACE(fused_gelu ? "linear_gelu" : "linear");
    Tensor<float> gx(x.shape()), gw(w.shape());
    gx.view().fill(0.0f);
    gw.view().fill(0.0f);
    Graph<float> g(*cpu_bf16);
    Var xv = g.leaf(x.view(), gx.view()), wv = g.leaf(w.view(), gw.view());
    // linear_gelu: the product checked before its GELU (the GELU's gradient enters dy below)
    Var y = fused_gelu ? ops::linear_gelu(g, xv, wv, Var{}) : ops::linear(g, xv, wv, Var{});
    const std::vector<float> y_host = g.to_host(y);
    if (!fused_gelu) near_reference(y_host, {false, true, rows, out, in, true}, x.data(), in, w.data(), in, "y");
    g.backward(ops::sum(g, ops::mul(g, y, g.constant(r.view()))));
    std::vector<float> dy(r.data(), r.data() + r.numel());
    if (fused_gelu)  // dy of the product: r GELU'(x W^T), the pre-activation from an FP32 graph of rounded operands
      for (int64_t i = 0; i < rows * out; ++i) {
        double pre = 0;
        for (int64_t p = 0; p < in; ++p)
          pre += double(round_to_bf16(x[(i / out) * in + p])) * round_to_bf16(w[(i % out) * in + p]);
        const double cdf = 0.5 * (1 + std::erf(pre / std::sqrt(2.0)));
        const double pdf = std::exp(-0.5 * pre * pre) / std::sqrt(2 * M_PI);
        dy[i] = static_cast<float>(r[i] * (cdf + pre * pdf));
      }
    near_reference({gx.data(), size_t(gx.numel())}, {false, false, rows, in, out, true}, dy.data(), out, w.data(), in,
                   "dx");
    near_reference({gw.data(), size_t(gw.numel())}, {true, false, out, in, rows, true}, dy.data(), out, x.data(), in,
                   "dW");
  }
  EXPECT_EQ(std::vector<float>(x.data(), x.data() + x.numel()), x_saved);
  // matmul (the attention products): a batched product, forward and both gradients.
  Tensor<float> a = random_floats({3, 40, 64}, 44), b = random_floats({3, 50, 64}, 45),
                rc = random_floats({3, 40, 50}, 46);
  Tensor<float> ga(a.shape()), gb(b.shape());
  ga.view().fill(0.0f);
  gb.view().fill(0.0f);
  Graph<float> g(*cpu_bf16);
  Var c = ops::matmul(g, g.leaf(a.view(), ga.view()), g.leaf(b.view(), gb.view()), false, true);  // A B^T
  const std::vector<float> c_host = g.to_host(c);
  g.backward(ops::sum(g, ops::mul(g, c, g.constant(rc.view()))));
  for (int64_t i = 0; i < 3; ++i) {
    const float *ai = a.data() + i * 40 * 64, *bi = b.data() + i * 50 * 64, *ri = rc.data() + i * 40 * 50;
    near_reference({c_host.data() + i * 40 * 50, 40 * 50}, {false, true, 40, 50, 64, true}, ai, 64, bi, 64, "C");
    near_reference({ga.data() + i * 40 * 64, 40 * 64}, {false, false, 40, 64, 50, true}, ri, 50, bi, 64, "dA");
    near_reference({gb.data() + i * 50 * 64, 50 * 64}, {true, false, 50, 64, 40, true}, ri, 50, ai, 64, "dB");
  }
  // TF32 is a GPU format: the CPU refuses it.
  EXPECT_THROW(Device::open("cpu", Precision::kTf32), UserError);
}

// ---------------------------------------------------------------- add / mul with broadcasting

// NumPy broadcasting written out with multi-indices.
Tensor<double> broadcast_reference(const Tensor<double>& a, const Tensor<double>& b, bool multiply) {
  const int rank = std::max(a.shape().rank(), b.shape().rank());
  auto dim = [&](const Shape& s, int d) { return d - (rank - s.rank()) >= 0 ? s[d - (rank - s.rank())] : 1; };
  Shape out = a.shape().rank() == rank ? a.shape() : b.shape();
  for (int d = 0; d < rank; ++d) out[d] = std::max(dim(a.shape(), d), dim(b.shape(), d));
  Tensor<double> y(out);
  for (int64_t f = 0; f < out.numel(); ++f) {
    std::vector<int64_t> idx = unravel(f, out);
    auto value = [&](const Tensor<double>& t) {
      const int off = rank - t.shape().rank();
      std::vector<int64_t> sub(t.shape().rank());
      for (int d = 0; d < t.shape().rank(); ++d) sub[d] = t.shape()[d] == 1 ? 0 : idx[d + off];
      return t[ravel(sub, t.shape())];
    };
    y[f] = multiply ? value(a) * value(b) : value(a) + value(b);
  }
  return y;
}

class BroadcastTest : public ::testing::TestWithParam<std::pair<Shape, Shape>> {};

TEST_P(BroadcastTest, AddAndMulMatchReferenceAndFiniteDifferences) {
  const auto [as, bs] = GetParam();
  for (bool multiply : {false, true}) {
    SCOPED_TRACE(multiply ? "mul" : "add");
    std::vector<Tensor<double>> in;
    in.push_back(random_tensor(as, 8));
    in.push_back(random_tensor(bs, 9));
    auto build = [&](Graph<double>& g, const Leaves& x) {
      return multiply ? ops::mul(g, x[0], x[1]) : ops::add(g, x[0], x[1]);
    };
    expect_tensors_near(run_forward(in, build), broadcast_reference(in[0], in[1], multiply), kForwardTolerance);
    expect_gradients_match(in, build);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, BroadcastTest,
                         ::testing::Values(std::pair{Shape{3, 4}, Shape{3, 4}},
                                           std::pair{Shape{2, 3, 4}, Shape{4}},              // bias
                                           std::pair{Shape{2, 1, 4}, Shape{3, 1}},           // both stretch
                                           std::pair{Shape{2, 3, 4, 5}, Shape{2, 1, 1, 5}},  // mask-like
                                           std::pair{Shape{1, 3, 1, 5}, Shape{2, 3, 4, 5}},  // first axis too
                                           std::pair{Shape{}, Shape{3, 2}},                  // scalar
                                           std::pair{Shape{5}, Shape{2, 3, 5}}));

TEST(Broadcast, SameInputTwiceAccumulatesBothPaths) {
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({3, 4}, 10));
  expect_gradients_match(in, [](Graph<double>& g, const Leaves& x) {
    return ops::add(g, ops::mul(g, x[0], x[0]), x[0]);  // x^2 + x
  });
}

// The add's backward hands dy itself to one operand; the other must get a gradient of its own, or the
// product's backward (which writes h's gradient while reading its output's) would read what it writes.
TEST(Broadcast, ResidualAddKeepsTheOperandsGradientsApart) {
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({4, 6}, 12));
  in.push_back(random_tensor({6, 6}, 13));
  for (bool product_first : {false, true}) {
    SCOPED_TRACE(product_first ? "h W + h" : "h + h W");
    expect_gradients_match(in, [product_first](Graph<double>& g, const Leaves& x) {
      Var h = ops::tanh(g, x[0]);  // an inner node: leaves never take dy's buffer
      Var product = ops::matmul(g, h, x[1]);
      return product_first ? ops::add(g, product, h) : ops::add(g, h, product);
    });
  }
}

// An op whose input is an inner node stores that node's gradient when it is the first to write it (the
// buffer is fresh and not zeroed) and adds to it otherwise; leaves, as in the checks above, always add.
// Each op here feeds two copies of itself from one inner node: the later copy's backward stores, the
// earlier one's adds.
TEST(InnerGradients, StoredFreshThenAddedByEveryOp) {
  using Op = std::function<Var(Graph<double>&, Var t, const Leaves& x)>;
  const std::vector<std::pair<const char*, Op>> cases = {
      {"scale", [](Graph<double>& g, Var t, const Leaves&) { return ops::scale(g, t, -0.5); }},
      {"gelu", [](Graph<double>& g, Var t, const Leaves&) { return ops::gelu(g, t); }},
      {"tanh", [](Graph<double>& g, Var t, const Leaves&) { return ops::tanh(g, t); }},
      {"dropout",
       [](Graph<double>& g, Var t, const Leaves&) {
         Rng rng(7);
         return ops::dropout(g, t, 0.25, true, rng);
       }},
      {"permute",
       [](Graph<double>& g, Var t, const Leaves&) {
         return ops::reshape(g, ops::permute(g, t, {1, 0}), {4, 4});
       }},
      {"softmax", [](Graph<double>& g, Var t, const Leaves&) { return ops::softmax(g, t); }},
      {"matmul, left", [](Graph<double>& g, Var t, const Leaves& x) { return ops::matmul(g, t, x[1]); }},
      {"matmul, right", [](Graph<double>& g, Var t, const Leaves& x) { return ops::matmul(g, x[1], t, true, false); }},
      {"linear", [](Graph<double>& g, Var t, const Leaves& x) { return ops::linear(g, t, x[1], x[2]); }},
      {"linear_gelu", [](Graph<double>& g, Var t, const Leaves& x) { return ops::linear_gelu(g, t, x[1], x[2]); }},
  };
  for (const auto& [name, op] : cases) {
    SCOPED_TRACE(name);
    std::vector<Tensor<double>> in;
    in.push_back(random_tensor({4, 4}, 21));
    in.push_back(random_tensor({4, 4}, 22));
    in.push_back(random_tensor({4}, 23));
    expect_gradients_match(in, [&op = op](Graph<double>& g, const Leaves& x) {
      Var t = ops::tanh(g, x[0]);  // inner
      return ops::add(g, op(g, t, x), ops::scale(g, op(g, t, x), 2.0));
    });
  }
}

TEST(Broadcast, RejectsIncompatibleShapes) {
  Graph<double> g;
  Tensor<double> a({3, 4}), b({3});
  EXPECT_THROW(ops::add(g, g.constant(a.view()), g.constant(b.view())), InternalError);
}

// ---------------------------------------------------------------- scale, gelu, tanh

TEST(Scale, MatchesReferenceAndFiniteDifferences) {
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({2, 3, 4}, 11));
  auto build = [](Graph<double>& g, const Leaves& x) { return ops::scale(g, x[0], -0.125); };
  Tensor<double> expected = in[0].clone();
  for (int64_t i = 0; i < expected.numel(); ++i) expected[i] *= -0.125;
  expect_tensors_near(run_forward(in, build), expected, kForwardTolerance);
  expect_gradients_match(in, build);
}

TEST(Gelu, MatchesPublishedValuesAndFiniteDifferences) {
  // x * Phi(x) at a few points, Phi from tables of the normal CDF (Phi(-3) = 0.0013498980316301).
  Tensor<double> points(Shape{5}, {-3.0, -1.0, 0.0, 1.0, 2.0});
  const std::array<double, 5> expected{-0.0040496940948903, -0.15865525393145707, 0.0, 0.8413447460685429,
                                       1.9544997361036416};
  std::vector<Tensor<double>> in;
  in.push_back(points.clone());
  auto build = [](Graph<double>& g, const Leaves& x) { return ops::gelu(g, x[0]); };
  Tensor<double> out = run_forward(in, build);
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(out[i], expected[i], 1e-12) << "gelu(" << points[i] << ")";
  for (Shape s : {Shape{7}, Shape{3, 5}, Shape{2, 3, 4}}) {
    std::vector<Tensor<double>> r;
    r.push_back(random_tensor(s, 12, 2.0));
    expect_gradients_match(r, build);
  }
}

TEST(Tanh, MatchesReferenceAndFiniteDifferences) {
  for (Shape s : {Shape{7}, Shape{3, 5}, Shape{2, 3, 4}}) {
    std::vector<Tensor<double>> in;
    in.push_back(random_tensor(s, 13, 1.5));
    auto build = [](Graph<double>& g, const Leaves& x) { return ops::tanh(g, x[0]); };
    Tensor<double> expected = in[0].clone();
    for (int64_t i = 0; i < expected.numel(); ++i)
      expected[i] = (std::exp(2 * in[0][i]) - 1) / (std::exp(2 * in[0][i]) + 1);
    expect_tensors_near(run_forward(in, build), expected, kForwardTolerance);
    expect_gradients_match(in, build);
  }
}

// ---------------------------------------------------------------- reshape, permute, transpose

TEST(Reshape, AliasesStorageAndPassesGradientsThrough) {
  Tensor<double> x = random_tensor({2, 3, 4}, 14);
  Graph<double> g;
  Var v = g.constant(x.view());
  Var r = ops::reshape(g, v, Shape{6, 4});
  EXPECT_EQ(g.value(r).data(), x.data()) << "reshape must not copy";
  EXPECT_EQ(g.shape(r), Shape({6, 4}));
  EXPECT_THROW(ops::reshape(g, v, Shape{5, 5}), InternalError);

  std::vector<Tensor<double>> in;
  in.push_back(x.clone());
  in.push_back(random_tensor({4, 3}, 15));
  // Reshape in the middle of a chain so its gradient has somewhere to come from.
  expect_gradients_match(in, [](Graph<double>& g, const Leaves& x) {
    return ops::matmul(g, ops::reshape(g, x[0], Shape{6, 4}), x[1]);
  });
}

Tensor<double> permute_reference(const Tensor<double>& x, const std::vector<int>& perm) {
  Shape out = x.shape();
  for (size_t i = 0; i < perm.size(); ++i) out[static_cast<int>(i)] = x.shape()[perm[i]];
  Tensor<double> y(out);
  for (int64_t f = 0; f < x.numel(); ++f) {
    std::vector<int64_t> src = unravel(f, x.shape()), dst(perm.size());
    for (size_t i = 0; i < perm.size(); ++i) dst[i] = src[perm[i]];
    y[ravel(dst, out)] = x[f];
  }
  return y;
}

TEST(Permute, MatchesReferenceAndFiniteDifferences) {
  struct Case {
    Shape s;
    std::vector<int> perm;
  };
  for (const Case& c : {Case{{2, 3, 4, 5}, {0, 2, 1, 3}}, Case{{2, 3, 4, 5}, {3, 1, 0, 2}}, Case{{3, 4, 5}, {2, 0, 1}},
                        Case{{3, 4}, {1, 0}}}) {
    SCOPED_TRACE(c.s.str());
    std::vector<Tensor<double>> in;
    in.push_back(random_tensor(c.s, 16));
    auto build = [&](Graph<double>& g, const Leaves& x) {
      switch (c.perm.size()) {
        case 2:
          return ops::permute(g, x[0], {c.perm[0], c.perm[1]});
        case 3:
          return ops::permute(g, x[0], {c.perm[0], c.perm[1], c.perm[2]});
        default:
          return ops::permute(g, x[0], {c.perm[0], c.perm[1], c.perm[2], c.perm[3]});
      }
    };
    expect_tensors_near(run_forward(in, build), permute_reference(in[0], c.perm), 0.0);
    expect_gradients_match(in, build);
  }
}

TEST(Transpose, SwapsTwoAxes) {
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({2, 3, 4}, 17));
  auto build = [](Graph<double>& g, const Leaves& x) { return ops::transpose(g, x[0], -1, 0); };
  expect_tensors_near(run_forward(in, build), permute_reference(in[0], {2, 1, 0}), 0.0);
  expect_gradients_match(in, build);
}

// ---------------------------------------------------------------- gather_rows (embedding)

TEST(GatherRows, PicksRowsAndScattersRepeatedIdsInBackward) {
  const std::vector<int32_t> ids{3, 0, 3, 6, 1, 3};  // 3 repeats: its gradient row sums three
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({7, 5}, 18));
  auto build = [&](Graph<double>& g, const Leaves& x) { return ops::gather_rows(g, x[0], ids, Shape{2, 3}); };
  Tensor<double> out = run_forward(in, build);
  ASSERT_EQ(out.shape(), Shape({2, 3, 5}));
  for (size_t i = 0; i < ids.size(); ++i)
    for (int c = 0; c < 5; ++c) EXPECT_EQ(out[i * 5 + c], in[0][ids[i] * 5 + c]);
  expect_gradients_match(in, build);

  Graph<double> g;
  const std::vector<int32_t> bad{7};
  EXPECT_THROW(ops::gather_rows(g, g.constant(in[0].view()), bad, Shape{1}), InternalError);
}

// ---------------------------------------------------------------- softmax

Tensor<double> softmax_reference(const Tensor<double>& x, const Tensor<double>* mask) {
  const int64_t k = x.shape().last(), rows = x.numel() / k, per_item = rows / x.shape()[0];
  Tensor<double> y(x.shape());
  for (int64_t r = 0; r < rows; ++r) {
    double total = 0;
    for (int64_t j = 0; j < k; ++j) total += std::exp(x[r * k + j] + (mask ? (*mask)[(r / per_item) * k + j] : 0));
    for (int64_t j = 0; j < k; ++j)
      y[r * k + j] = std::exp(x[r * k + j] + (mask ? (*mask)[(r / per_item) * k + j] : 0)) / total;
  }
  return y;
}

TEST(Softmax, WithoutMaskMatchesReferenceAndFiniteDifferences) {
  for (Shape s : {Shape{4, 6}, Shape{2, 3, 6}, Shape{2, 2, 3, 5}}) {
    std::vector<Tensor<double>> in;
    in.push_back(random_tensor(s, 19, 2.0));
    auto build = [](Graph<double>& g, const Leaves& x) { return ops::softmax(g, x[0]); };
    expect_tensors_near(run_forward(in, build), softmax_reference(in[0], nullptr), kForwardTolerance);
    expect_gradients_match(in, build);
  }
}

TEST(Softmax, AdditivePaddingMaskSendsMaskedProbabilityToZero) {
  // (B=2, H=2, T=3, K=5), mask (B, K): item 0 masks its last two keys, item 1 none.
  Tensor<double> mask(Shape{2, 5}, {0, 0, 0, -1e4, -1e4, 0, 0, 0, 0, 0});
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({2, 2, 3, 5}, 20));
  in.push_back(mask.clone());
  auto build = [](Graph<double>& g, const Leaves& x) { return ops::softmax(g, x[0], x[1]); };
  Tensor<double> out = run_forward(in, build);
  expect_tensors_near(out, softmax_reference(in[0], &in[1]), kForwardTolerance);
  for (int64_t r = 0; r < 6; ++r) {  // item 0's rows
    EXPECT_LT(out[r * 5 + 3], 1e-12);
    EXPECT_LT(out[r * 5 + 4], 1e-12);
  }
  GradCheckOptions options;
  options.differentiable = {true, false};
  expect_gradients_match(in, build, options);

  // The mask is a constant: asking for its gradient is an error, not a silent zero.
  Graph<double> g;
  Tensor<double> mask_grad(mask.shape());
  EXPECT_THROW(ops::softmax(g, g.constant(in[0].view()), g.leaf(mask.view(), mask_grad.view())), InternalError);
}

// ---------------------------------------------------------------- layer_norm

Tensor<double> layer_norm_reference(const Tensor<double>& x, const Tensor<double>& gamma, const Tensor<double>& beta,
                                    double eps) {
  const int64_t c = x.shape().last(), rows = x.numel() / c;
  Tensor<double> y(x.shape());
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t j = 0; j < c; ++j) mean += x[r * c + j] / c;
    for (int64_t j = 0; j < c; ++j) var += (x[r * c + j] - mean) * (x[r * c + j] - mean) / c;
    for (int64_t j = 0; j < c; ++j) y[r * c + j] = (x[r * c + j] - mean) / std::sqrt(var + eps) * gamma[j] + beta[j];
  }
  return y;
}

TEST(LayerNorm, MatchesReferenceAndFiniteDifferences) {
  for (double eps : {1e-12, 1e-5}) {
    // {130, 3}: rows in three blocks of the parameter gradients' sums.
    for (Shape s : {Shape{4, 6}, Shape{2, 3, 8}, Shape{1, 2, 2, 5}, Shape{130, 3}}) {
      SCOPED_TRACE(s.str() + " eps " + std::to_string(eps));
      std::vector<Tensor<double>> in;
      in.push_back(random_tensor(s, 21, 3.0));
      in.push_back(random_tensor({s.last()}, 22));
      in.push_back(random_tensor({s.last()}, 23));
      auto build = [eps](Graph<double>& g, const Leaves& x) { return ops::layer_norm(g, x[0], x[1], x[2], eps); };
      expect_tensors_near(run_forward(in, build), layer_norm_reference(in[0], in[1], in[2], eps), 1e-11);
      expect_gradients_match(in, build);
    }
  }
}

// The residual add fused in: finite differences in double (both addends, gamma, beta), and in float the
// same bits as layer_norm(add(a, b)), with and without gradients, a used elsewhere too (its gradient
// accumulates) and b a constant.
// On the CPU dropout_add_layer_norm is dropout then add_layer_norm with the same draws: checked against
// finite differences (a fixed mask: the rng restarts at each evaluation) and bit for bit against the ops.
TEST(DropoutAddLayerNorm, IsDropoutThenAddLayerNorm) {
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({5, 8}, 51, 2.0));
  in.push_back(random_tensor({5, 8}, 52, 2.0));
  in.push_back(random_tensor({8}, 53));
  in.push_back(random_tensor({8}, 54));
  auto build = [](Graph<double>& g, const Leaves& x) {
    Rng rng(9);
    return ops::dropout_add_layer_norm(g, x[0], x[1], x[2], x[3], 1e-5, 0.3, /*training=*/true, rng);
  };
  expect_gradients_match(in, build);
  auto composed = [](Graph<double>& g, const Leaves& x) {
    Rng rng(9);
    return ops::add_layer_norm(g, ops::dropout(g, x[0], 0.3, /*training=*/true, rng), x[1], x[2], x[3], 1e-5);
  };
  expect_tensors_near(run_forward(in, build), run_forward(in, composed), 0.0);
  auto evaluation = [](Graph<double>& g, const Leaves& x) {
    Rng rng(9);
    return ops::dropout_add_layer_norm(g, x[0], x[1], x[2], x[3], 1e-5, 0.3, /*training=*/false, rng);
  };
  auto plain = [](Graph<double>& g, const Leaves& x) { return ops::add_layer_norm(g, x[0], x[1], x[2], x[3], 1e-5); };
  expect_tensors_near(run_forward(in, evaluation), run_forward(in, plain), 0.0);
}

TEST(AddLayerNorm, MatchesFiniteDifferencesAndTheTwoOpsBitForBit) {
  for (Shape s : {Shape{4, 6}, Shape{130, 3}}) {
    SCOPED_TRACE(s.str());
    std::vector<Tensor<double>> in;
    in.push_back(random_tensor(s, 41, 3.0));
    in.push_back(random_tensor(s, 42, 2.0));
    in.push_back(random_tensor({s.last()}, 43));
    in.push_back(random_tensor({s.last()}, 44));
    auto build = [](Graph<double>& g, const Leaves& x) { return ops::add_layer_norm(g, x[0], x[1], x[2], x[3], 1e-5); };
    Tensor<double> sum(s);
    for (int64_t i = 0; i < sum.numel(); ++i) sum[i] = in[0][i] + in[1][i];
    expect_tensors_near(run_forward(in, build), layer_norm_reference(sum, in[2], in[3], 1e-5), 1e-11);
    expect_gradients_match(in, build);
  }
  Tensor<float> a = random_floats({3, 70, 96}, 45, 3.0), b = random_floats({3, 70, 96}, 46, 3.0);
  Tensor<float> gamma = random_floats({96}, 47), beta = random_floats({96}, 48), r = random_floats({3, 70, 96}, 49);
  struct Run {
    std::vector<float> y, da, dgamma, dbeta;
  };
  auto run = [&](bool fused, bool gradients) {
    Run out;
    Tensor<float> ga(a.shape()), ggamma(gamma.shape()), gbeta(beta.shape());
    for (Tensor<float>* t : {&ga, &ggamma, &gbeta}) t->view().fill(0.0f);
    Graph<float> g;
    g.set_grad_enabled(gradients);
    Var av = g.leaf(a.view(), ga.view()), bv = g.constant(b.view());
    Var gv = g.leaf(gamma.view(), ggamma.view()), betav = g.leaf(beta.view(), gbeta.view());
    Var y = fused ? ops::add_layer_norm(g, av, bv, gv, betav) : ops::layer_norm(g, ops::add(g, av, bv), gv, betav);
    TensorView<float> yv = g.value(y);
    out.y.assign(yv.data(), yv.data() + yv.numel());
    if (gradients) {
      // a also feeds the loss directly: its gradient is accumulated, not stored.
      g.backward(ops::add(g, ops::sum(g, ops::mul(g, y, g.constant(r.view()))), ops::sum(g, av)));
      out.da.assign(ga.data(), ga.data() + ga.numel());
      out.dgamma.assign(ggamma.data(), ggamma.data() + ggamma.numel());
      out.dbeta.assign(gbeta.data(), gbeta.data() + gbeta.numel());
    }
    return out;
  };
  const Run two_ops = run(false, true), fused = run(true, true), inference = run(true, false);
  EXPECT_EQ(fused.y, two_ops.y);
  EXPECT_EQ(inference.y, two_ops.y);
  EXPECT_EQ(fused.da, two_ops.da);
  EXPECT_EQ(fused.dgamma, two_ops.dgamma);
  EXPECT_EQ(fused.dbeta, two_ops.dbeta);
  Graph<float> g;
  EXPECT_THROW(ops::add_layer_norm(g, g.constant(a.view()), g.constant(gamma.view()), g.constant(gamma.view()),
                                   g.constant(beta.view())),
               std::exception);  // addends of different shapes
}

// ---------------------------------------------------------------- dropout

TEST(Dropout, IdentityInEvalAndWithZeroProbability) {
  Tensor<double> x = random_tensor({4, 5}, 24);
  Graph<double> g;
  Rng rng(1);
  Var v = g.constant(x.view());
  EXPECT_EQ(ops::dropout(g, v, 0.5, /*training=*/false, rng).index, v.index);
  EXPECT_EQ(ops::dropout(g, v, 0.0, /*training=*/true, rng).index, v.index);
  EXPECT_EQ(rng.state().counter, 0u) << "an identity dropout must not consume random numbers";
  EXPECT_THROW(ops::dropout(g, v, 1.0, true, rng), InternalError);
}

TEST(Dropout, DropsAboutPAndScalesSurvivors) {
  const double p = 0.3;
  const int64_t n = 200000;
  Tensor<double> ones(Shape{n}, std::vector<double>(n, 1.0));
  Graph<double> g;
  Rng rng(7);
  TensorView<double> y = g.value(ops::dropout(g, g.constant(ones.view()), p, true, rng));
  int64_t zeros = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (y[i] == 0.0) {
      ++zeros;
    } else {
      ASSERT_NEAR(y[i], 1.0 / (1.0 - p), 1e-15);
    }
  }
  // Binomial(n, p): standard deviation ~205; allow 5 of them.
  EXPECT_NEAR(static_cast<double>(zeros), p * n, 5 * std::sqrt(n * p * (1 - p)));
  EXPECT_EQ(rng.state().counter, static_cast<uint64_t>(n));
}

// The draws every dropout kernel shares (core/rng.h): a block starts at a multiple of four, four elements
// read the four 16-bit fields of one hash, and kept() and kept4() agree on each of them.
TEST(Dropout, DrawsShareOneHashAmongFourAlignedElements) {
  Rng rng(5);
  rng.reserve(3);
  EXPECT_EQ(DropoutDraws::reserve(rng, 10), 4u) << "a block starts at a multiple of four";
  EXPECT_EQ(DropoutDraws::reserve(rng, 8), 16u);
  EXPECT_EQ(rng.state().counter, 24u);
  EXPECT_EQ(DropoutDraws::threshold(0.1), 6554u);  // ceil(0.1 x 65536)
  EXPECT_EQ(DropoutDraws::threshold(0.0), 0u);
  const uint64_t seed = rng.state().seed;
  const uint32_t threshold = DropoutDraws::threshold(0.5);
  int64_t kept = 0;
  for (uint64_t group = 0; group < 1000; ++group) {
    const uint32_t four = DropoutDraws::kept4(seed, group, threshold);
    const uint64_t h = Rng::hash(seed, group);
    for (uint64_t l = 0; l < 4; ++l) {
      const bool k = DropoutDraws::kept(seed, 4 * group + l, threshold);
      ASSERT_EQ(k, bool((four >> l) & 1u)) << "element " << 4 * group + l;
      ASSERT_EQ(k, ((h >> (16 * l)) & 0xFFFFu) >= threshold);
      kept += k;
    }
  }
  EXPECT_NEAR(double(kept), 2000.0, 5 * std::sqrt(4000 * 0.25));
  // A dropout op of 6 elements after one of 5: the second starts at element 8 of the stream.
  Tensor<double> ones(Shape{6}, std::vector<double>(6, 1.0));
  Graph<double> g;
  Rng stream(11);
  ops::dropout(g, g.constant(Tensor<double>(Shape{5}, std::vector<double>(5, 1.0)).view()), 0.5, true, stream);
  TensorView<double> y = g.value(ops::dropout(g, g.constant(ones.view()), 0.5, true, stream));
  for (uint64_t i = 0; i < 6; ++i)
    EXPECT_EQ(y[i] != 0.0, DropoutDraws::kept(stream.state().seed, 8 + i, threshold)) << "element " << i;
  EXPECT_EQ(stream.state().counter, 14u);
}

TEST(Dropout, SameSeedSameMaskAndFiniteDifferences) {
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({3, 4, 5}, 25));
  // Each forward gets a fresh generator with the same seed, so every evaluation uses one mask.
  auto build = [](Graph<double>& g, const Leaves& x) {
    Rng rng(99);
    return ops::dropout(g, x[0], 0.25, true, rng);
  };
  Tensor<double> a = run_forward(in, build), b = run_forward(in, build);
  expect_tensors_near(a, b, 0.0);
  expect_gradients_match(in, build);
}

// ---------------------------------------------------------------- attention

// softmax(alpha q k^T + mask) v per head, written out by hand: (B, T, H D) operands, (B, T) additive mask.
Tensor<double> attention_reference(const Tensor<double>& q, const Tensor<double>& k, const Tensor<double>& v,
                                   const Tensor<double>& mask, int64_t h, double alpha) {
  const Shape& s = q.shape();
  const int64_t b = s[0], t = s[1], c = s[2], d = c / h;
  auto at = [&](int64_t bi, int64_t pos, int64_t head, int64_t e) { return (bi * t + pos) * c + head * d + e; };
  Tensor<double> out(s);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t head = 0; head < h; ++head)
      for (int64_t i = 0; i < t; ++i) {
        std::vector<double> p(static_cast<size_t>(t));
        double max = -1e300, sum = 0;
        for (int64_t j = 0; j < t; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < d; ++e) dot += q[at(bi, i, head, e)] * k[at(bi, j, head, e)];
          p[j] = alpha * dot + mask[bi * t + j];
          max = std::max(max, p[j]);
        }
        for (double& x : p) sum += x = std::exp(x - max);
        for (int64_t e = 0; e < d; ++e) {
          double acc = 0;
          for (int64_t j = 0; j < t; ++j) acc += p[j] / sum * v[at(bi, j, head, e)];
          out[at(bi, i, head, e)] = acc;
        }
      }
  return out;
}

TEST(Attention, MatchesAHandWrittenReferenceAndFiniteDifferences) {
  const Shape s{2, 5, 6};  // two heads of 3
  Tensor<double> mask(Shape{2, 5}, {0, 0, 0, 0, 0, 0, 0, 0, -1e4, -1e4});  // item 1: last two keys padded
  std::vector<Tensor<double>> in;
  for (uint32_t seed : {31u, 32u, 33u}) in.push_back(random_tensor(s, seed));
  in.push_back(mask.clone());
  const double alpha = 0.6;
  auto build = [&](double p) {
    return [alpha, p](Graph<double>& g, const Leaves& x) {
      Rng rng(5);
      return ops::attention(g, x[0], x[1], x[2], x[3], 2, alpha, p, /*training=*/true, rng);
    };
  };
  expect_tensors_near(run_forward(in, build(0.0)), attention_reference(in[0], in[1], in[2], in[3], 2, alpha),
                      kForwardTolerance);
  GradCheckOptions options;
  options.differentiable = {true, true, true, false};
  expect_gradients_match(in, build(0.0), options);
  expect_gradients_match(in, build(0.3), options);  // dropout: one mask for every evaluation (same seed)
}

// self_attention on the CPU: attention on three linears of x (the hand-written reference on the
// projections), gradients of x, the weights and the biases against finite differences.
TEST(Attention, SelfAttentionIsAttentionOnThreeLinearsWithItsGradients) {
  const Shape s{2, 5, 6};
  Tensor<double> mask(Shape{2, 5}, {0, 0, 0, 0, 0, 0, 0, 0, -1e4, -1e4});
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor(s, 41));
  for (uint32_t seed : {42u, 44u, 46u}) {
    in.push_back(random_tensor(Shape{6, 6}, seed));
    in.push_back(random_tensor(Shape{6}, seed + 1));
  }
  in.push_back(mask.clone());
  const double alpha = 0.6;
  auto build = [&](double p) {
    return [alpha, p](Graph<double>& g, const Leaves& x) {
      Rng rng(5);
      return ops::self_attention(g, x[0], {x[1], x[3], x[5]}, {x[2], x[4], x[6]}, x[7], 2, alpha, p,
                                 /*training=*/true, rng);
    };
  };
  // The projections by hand: x W^T + b.
  std::vector<Tensor<double>> projected;
  for (int i = 0; i < 3; ++i) {
    Tensor<double> y(s);
    const Tensor<double>& w = in[1 + 2 * i];
    const Tensor<double>& b = in[2 + 2 * i];
    for (int64_t r = 0; r < 10; ++r)
      for (int64_t o = 0; o < 6; ++o) {
        double acc = b[o];
        for (int64_t k = 0; k < 6; ++k) acc += in[0][r * 6 + k] * w[o * 6 + k];
        y[r * 6 + o] = acc;
      }
    projected.push_back(std::move(y));
  }
  expect_tensors_near(run_forward(in, build(0.0)),
                      attention_reference(projected[0], projected[1], projected[2], in[7], 2, alpha),
                      kForwardTolerance);
  GradCheckOptions options;
  options.differentiable = {true, true, true, true, true, true, true, false};
  expect_gradients_match(in, build(0.0), options);
  expect_gradients_match(in, build(0.3), options);
  Graph<double> g;  // a projection of another width
  Rng rng(1);
  const Var x = g.constant(in[0].view()), w = g.constant(in[1].view()), b = g.constant(in[2].view());
  Tensor<double> narrow = random_tensor(Shape{4, 6}, 9);
  EXPECT_THROW(
      ops::self_attention(g, x, {w, g.constant(narrow.view()), w}, {b, b, b}, Var{}, 2, alpha, 0.0, false, rng),
      std::exception);
}

// ---------------------------------------------------------------- cross_entropy, sum, mean

double cross_entropy_reference(const Tensor<double>& z, const std::vector<int32_t>& t, const std::vector<double>& w,
                               int32_t ignore) {
  const int64_t c = z.shape()[1];
  double loss = 0, total = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == ignore) continue;
    double denom = 0;
    for (int64_t j = 0; j < c; ++j) denom += std::exp(z[i * c + j]);
    const double wi = w.empty() ? 1.0 : w[i];
    loss += wi * -std::log(std::exp(z[i * c + t[i]]) / denom);
    total += wi;
  }
  return loss / total;
}

TEST(CrossEntropy, IgnoredRowsAndWeightsMatchReferenceAndFiniteDifferences) {
  const std::vector<int32_t> targets{2, -1, 0, 4, -1, 1};
  const std::vector<double> weights{1.0, 5.0, 0.5, 2.0, 1.0, 0.25};
  for (bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "weighted" : "unweighted");
    std::vector<Tensor<double>> in;
    in.push_back(random_tensor({6, 5}, 26, 2.0));
    auto build = [&](Graph<double>& g, const Leaves& x) {
      return weighted ? ops::cross_entropy<double>(g, x[0], targets, weights)
                      : ops::cross_entropy<double>(g, x[0], targets);
    };
    Tensor<double> out = run_forward(in, build);
    ASSERT_EQ(out.shape(), Shape{});
    EXPECT_NEAR(out[0], cross_entropy_reference(in[0], targets, weighted ? weights : std::vector<double>{}, -1),
                kForwardTolerance);
    expect_gradients_match(in, build);
  }
}

TEST(DistillationLoss, IsTheTemperatureScaledKlAndMatchesFiniteDifferences) {
  for (double temperature : {1.0, 2.5}) {
    SCOPED_TRACE(temperature);
    std::vector<Tensor<double>> in;
    in.push_back(random_tensor({4, 7}, 31, 2.0));  // student
    in.push_back(random_tensor({4, 7}, 32, 2.0));  // teacher
    auto build = [temperature](Graph<double>& g, const Leaves& x) {
      return ops::distillation_loss(g, x[0], x[1], temperature);
    };
    GradCheckOptions options;
    options.differentiable = {true, false};
    // The reference: T^2 / N sum_i sum_j p_ij (log p_ij - log q_ij), written out.
    double expected = 0;
    for (int64_t i = 0; i < 4; ++i) {
      double zs = 0, zt = 0;
      for (int64_t j = 0; j < 7; ++j)
        zs += std::exp(in[0][i * 7 + j] / temperature), zt += std::exp(in[1][i * 7 + j] / temperature);
      for (int64_t j = 0; j < 7; ++j) {
        const double p = std::exp(in[1][i * 7 + j] / temperature) / zt,
                     q = std::exp(in[0][i * 7 + j] / temperature) / zs;
        expected += p * std::log(p / q);
      }
    }
    expected *= temperature * temperature / 4;
    Graph<double> g;
    Tensor<double> teacher = in[1].clone();
    const double value =
        g.value(ops::distillation_loss(g, g.constant(in[0].view()), g.constant(teacher.view()), temperature))[0];
    EXPECT_NEAR(value, expected, kForwardTolerance);
    expect_gradients_match(in, build, options);
  }
  // The same logits: zero loss. A teacher that takes gradients: an error.
  Graph<double> g;
  Tensor<double> a = random_tensor({2, 3}, 33), grad({2, 3});
  EXPECT_NEAR(g.value(ops::distillation_loss(g, g.constant(a.view()), g.constant(a.view()), 2.0))[0], 0.0, 1e-15);
  EXPECT_THROW(ops::distillation_loss(g, g.constant(a.view()), g.leaf(a.view(), grad.view()), 1.0), InternalError);
}

// A regression's loss: mean_i (p_i - t_i)^2 by hand; the gradient 2 (p - t) / N against finite differences;
// targets of another shape but as many values (B) against predictions (B, 1); targets that take gradients
// or hold another count are errors.
TEST(MeanSquaredError, MatchesTheSumByHandAndFiniteDifferences) {
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({5, 1}, 41, 3.0));  // predictions
  in.push_back(random_tensor({5}, 42, 3.0));     // targets
  double expected = 0;
  for (int64_t i = 0; i < 5; ++i) expected += (in[0][i] - in[1][i]) * (in[0][i] - in[1][i]);
  expected /= 5;
  ASSERT_GT(expected, 0.1);
  Graph<double> g;
  Tensor<double> targets = in[1].clone();
  EXPECT_NEAR(g.item(ops::mean_squared_error(g, g.constant(in[0].view()), g.constant(targets.view()))), expected,
              kForwardTolerance);
  auto build = [](Graph<double>& g, const Leaves& x) { return ops::mean_squared_error(g, x[0], x[1]); };
  GradCheckOptions options;
  options.differentiable = {true, false};
  expect_gradients_match(in, build, options);
  Tensor<double> a = random_tensor({2, 3}, 43), grad({2, 3}), three = random_tensor({3}, 44);
  EXPECT_NEAR(g.item(ops::mean_squared_error(g, g.constant(a.view()), g.constant(a.view()))), 0.0, 1e-15);
  EXPECT_THROW(ops::mean_squared_error(g, g.constant(a.view()), g.leaf(a.view(), grad.view())), InternalError);
  EXPECT_THROW(ops::mean_squared_error(g, g.constant(a.view()), g.constant(three.view())), InternalError);
}

TEST(CrossEntropy, AllRowsIgnoredGivesZeroLoss) {
  const std::vector<int32_t> targets{-1, -1};
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({2, 3}, 27));
  auto build = [&](Graph<double>& g, const Leaves& x) { return ops::cross_entropy<double>(g, x[0], targets); };
  EXPECT_EQ(run_forward(in, build)[0], 0.0);
  expect_gradients_match(in, build);
}

// On the CPU cross_entropy_scores composes cross_entropy and row_argmax: the same loss, gradient and
// predictions (checked against finite differences as the op it composes).
TEST(CrossEntropy, ScoresAreTheLossAndTheArgmax) {
  const std::vector<int32_t> targets{2, 0, 4};
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({3, 5}, 29));
  in[0][1 * 5 + 1] = in[0][1 * 5 + 3] = 9.0;  // a tie: the first wins
  Graph<double> g;
  Var x = g.constant(in[0].view());
  const ops::LinearScores scores = ops::cross_entropy_scores<double>(g, x, targets);
  EXPECT_EQ(scores.predictions, ops::row_argmax(g, x));
  EXPECT_EQ(scores.predictions[1], 1);
  EXPECT_EQ(g.item(scores.loss), g.item(ops::cross_entropy<double>(g, x, targets)));
  expect_gradients_match(
      in, [&](Graph<double>& g, const Leaves& x) { return ops::cross_entropy_scores<double>(g, x[0], targets).loss; });
}

TEST(CrossEntropy, RejectsTargetOutsideClasses) {
  Graph<double> g;
  Tensor<double> z({2, 3});
  const std::vector<int32_t> targets{0, 3};
  EXPECT_THROW(ops::cross_entropy<double>(g, g.constant(z.view()), targets), InternalError);
}

TEST(SumMean, MatchReferenceAndFiniteDifferences) {
  for (Shape s : {Shape{5}, Shape{3, 4}, Shape{2, 3, 4}}) {
    std::vector<Tensor<double>> in;
    in.push_back(random_tensor(s, 28));
    double total = 0;
    for (int64_t i = 0; i < in[0].numel(); ++i) total += in[0][i];
    auto build_sum = [](Graph<double>& g, const Leaves& x) { return ops::sum(g, x[0]); };
    auto build_mean = [](Graph<double>& g, const Leaves& x) { return ops::mean(g, x[0]); };
    EXPECT_NEAR(run_forward(in, build_sum)[0], total, kForwardTolerance);
    EXPECT_NEAR(run_forward(in, build_mean)[0], total / in[0].numel(), kForwardTolerance);
    expect_gradients_match(in, build_sum);
    expect_gradients_match(in, build_mean);
  }
}

// ---------------------------------------------------------------- row_argmax

// The first position of each row's largest value, as std::max_element: ties, infinities, NaNs, rows
// of every length around the vector width, in float and double.
template <typename T>
void expect_row_argmax_is_max_element() {
  Rng rng(17);
  for (int64_t cols : {1, 7, 16, 17, 33, 1000}) {
    const int64_t rows = 7;
    std::vector<T> v(rows * cols);
    for (auto& x : v) x = static_cast<T>(std::round(rng.next_normal() * 3.0));  // small integers: many ties
    for (int64_t i = 0; i < cols; ++i) v[1 * cols + i] = -std::numeric_limits<T>::infinity();
    v[2 * cols + cols / 2] = std::numeric_limits<T>::infinity();
    v[3 * cols + cols / 3] = std::numeric_limits<T>::quiet_NaN();
    for (int64_t i = 0; i < cols; ++i) v[4 * cols + i] = T(2);   // all equal
    for (int64_t i = 0; i < cols; ++i) v[5 * cols + i] = T(-i);  // the largest first, a NaN just after it
    if (cols > 1) v[5 * cols + 1] = std::numeric_limits<T>::quiet_NaN();
    v[6 * cols] = std::numeric_limits<T>::quiet_NaN();  // a NaN first: std::max_element stays on it
    Graph<T> g;
    const std::vector<int32_t> got = ops::row_argmax(g, g.constant(TensorView<T>(v.data(), Shape{rows, cols})));
    ASSERT_EQ(static_cast<int64_t>(got.size()), rows);
    for (int64_t r = 0; r < rows; ++r)
      EXPECT_EQ(got[r], std::max_element(v.begin() + r * cols, v.begin() + (r + 1) * cols) - (v.begin() + r * cols))
          << cols << " columns, row " << r;
  }
}

TEST(RowArgmax, IsTheFirstLargestAsMaxElementGivesIt) {
  expect_row_argmax_is_max_element<float>();
  expect_row_argmax_is_max_element<double>();
}

// ---------------------------------------------------------------- scoring without logits

// What scoring from tiles must give: cross_entropy's loss (up to summation order) and row_argmax's predictions of
// the logits it never stores; the same on one and two threads, bit for bit.
void expect_scores_of_logits(const std::function<ops::LinearScores(Graph<float>&)>& scores,
                             const std::function<Var(Graph<float>&)>& logits, std::span<const int32_t> targets,
                             const Device& device, int32_t tied_row_prediction) {
  const int saved = omp_get_max_threads();
  float first_loss = 0;
  for (int threads : {1, 2}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    omp_set_num_threads(threads);
    Graph<float> g(device);
    NoGradGuard<float> no_grad(g);
    const Var z = logits(g);
    const float expected = g.item(ops::cross_entropy<float>(g, z, targets));
    const std::vector<int32_t> predicted = ops::row_argmax(g, z);
    const ops::LinearScores got = scores(g);
    const float loss = g.item(got.loss);
    EXPECT_NEAR(loss, expected, 1e-5 * std::abs(expected));
    EXPECT_EQ(got.predictions, predicted);
    EXPECT_EQ(got.predictions[0], tied_row_prediction);  // a tie between two tiles: the first column
    if (threads == 1) first_loss = loss;
    EXPECT_EQ(loss, first_loss);
  }
  omp_set_num_threads(saved);
}

TEST(LinearScores, AreTheCrossEntropyAndArgmaxOfTheLogits) {
  const int64_t rows = 300, in = 64, out = 1100;  // several row and column tiles, ragged at both ends
  Tensor<float> x = random_floats({rows, in}, 51), w = random_floats({out, in}, 52), bias = random_floats({out}, 53);
  // Row 0 of x points along weight row 3, which row 700 (another column tile) repeats: a tie at the top.
  for (int64_t i = 0; i < in; ++i) w[700 * in + i] = w[3 * in + i], x[i] = 10.0f * w[3 * in + i];
  bias[700] = bias[3];
  std::vector<int32_t> targets(rows);
  Rng rng(54);
  for (auto& t : targets) t = static_cast<int32_t>(rng.next_below(out));
  for (Precision precision : {Precision::kFp32, Precision::kBf16}) {
    SCOPED_TRACE(precision == Precision::kBf16 ? "bf16 products" : "fp32");
    const std::unique_ptr<Device> cpu = Device::open("cpu", precision);
    expect_scores_of_logits(
        [&](Graph<float>& g) {
          return ops::linear_cross_entropy_scores(g, g.constant(x.view()), g.constant(w.view()),
                                                  g.constant(bias.view()), targets);
        },
        [&](Graph<float>& g) {
          return ops::linear(g, g.constant(x.view()), g.constant(w.view()), g.constant(bias.view()));
        },
        targets, *cpu, 3);
  }

  // The integer decoder's product (x quantized per row at run time).
  std::vector<int8_t> q(out * in);
  for (int64_t i = 0; i < out * in; ++i) q[i] = static_cast<int8_t>(std::clamp(std::lround(w[i] * 40.0f), -127L, 127L));
  const Int8Weights packed(q.data(), out, in);
  const std::vector<float> scale_w(out, 1.0f / 40.0f);
  const std::unique_ptr<Device> cpu = Device::open("cpu");
  expect_scores_of_logits(
      [&](Graph<float>& g) {
        return ops::int8_linear_dynamic_cross_entropy_scores(g, g.constant(x.view()), packed, scale_w,
                                                             g.constant(bias.view()), targets);
      },
      [&](Graph<float>& g) {
        return ops::int8_linear_dynamic(g, g.constant(x.view()), packed, scale_w, g.constant(bias.view()));
      },
      targets, *cpu, 3);

  // A row of NaN logits: NaN loss and prediction 0, as cross_entropy and row_argmax give.
  Tensor<float> nan_x = random_floats({rows, in}, 51);
  nan_x[5 * in + 7] = std::numeric_limits<float>::quiet_NaN();
  Graph<float> g;
  NoGradGuard<float> no_grad(g);
  const ops::LinearScores nan_scores = ops::linear_cross_entropy_scores(
      g, g.constant(nan_x.view()), g.constant(w.view()), g.constant(bias.view()), targets);
  EXPECT_TRUE(std::isnan(g.item(nan_scores.loss)));
  EXPECT_EQ(nan_scores.predictions[5], 0);

  // Bad input: a target outside the vocabulary, a wrong width, and a graph that records gradients.
  std::vector<int32_t> bad = targets;
  bad[9] = static_cast<int32_t>(out);
  EXPECT_THROW(ops::linear_cross_entropy_scores(g, g.constant(x.view()), g.constant(w.view()), Var{}, bad),
               std::exception);
  EXPECT_THROW(ops::linear_cross_entropy_scores(g, g.constant(w.view()), g.constant(x.view()), Var{}, targets),
               std::exception);
  Graph<float> recording;
  EXPECT_THROW(ops::linear_cross_entropy_scores(recording, recording.constant(x.view()), recording.constant(w.view()),
                                                Var{}, targets),
               std::exception);
}

// ---------------------------------------------------------------- composition

TEST(Composition, AttentionBlockGradientsMatchFiniteDifferences) {
  // softmax(Q K^T / sqrt(D) + mask) V with heads split by reshape + permute: the ops as BERT chains them.
  const int64_t B = 2, T = 3, H = 2, D = 2, C = H * D;
  Tensor<double> mask(Shape{B, T}, {0, 0, -1e4, 0, 0, 0});
  std::vector<Tensor<double>> in;
  in.push_back(random_tensor({B, T, C}, 29));
  in.push_back(random_tensor({3 * C, C}, 30, 0.5));
  in.push_back(random_tensor({3 * C}, 31));
  in.push_back(mask.clone());
  auto build = [&](Graph<double>& g, const Leaves& x) {
    Var qkv = ops::linear(g, x[0], x[1], x[2]);  // (B, T, 3C)
    auto head = [&](int part) {
      // Pick Q, K or V from the packed projection by a tiny gather over the 3C axis.
      Var flat = ops::reshape(g, qkv, Shape{B * T, 3, C});
      Var parts = ops::permute(g, flat, {1, 0, 2});  // (3, B*T, C)
      Var one = ops::reshape(g, parts, Shape{3, B * T * C});
      std::vector<int32_t> id{part};
      Var picked = ops::gather_rows(g, one, id, Shape{});
      return ops::permute(g, ops::reshape(g, picked, Shape{B, T, H, D}), {0, 2, 1, 3});  // (B, H, T, D)
    };
    Var q = head(0), k = head(1), v = head(2);
    Var scores = ops::scale(g, ops::matmul(g, q, k, false, true), 1.0 / std::sqrt(double(D)));
    Var probs = ops::softmax(g, scores, x[3]);
    return ops::matmul(g, probs, v);  // (B, H, T, D)
  };
  GradCheckOptions options;
  options.differentiable = {true, true, true, false};
  expect_gradients_match(in, build, options);
}

}  // namespace
}  // namespace bert
