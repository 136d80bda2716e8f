// Every primitive op on a CUDA GPU against the same op on the CPU: forward values and the gradients
// of every input (from a random upstream gradient), at several shapes including odd sizes, broadcast
// axes, repeated ids and ignored rows. Each comparison runs twice on the GPU: in FP32 (tolerances named
// per op) and in BF16 mixed precision (BF16 activations and gradients; kBf16 unless named). Skips
// without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/arena.h"
#include "core/device.h"
#if BERT_WITH_CUDA
#include "core/cuda/context.h"
#include "core/cuda/lt_plans.h"
#endif
#include "ops/ops.h"

namespace bert {
namespace {

using Build = std::function<Var(Graph<float>&, const std::vector<Var>&)>;

// Relative tolerances (max |gpu - cpu| / max |cpu|) per op family, FP32 on both sides.
constexpr double kExact = 0;           // same arithmetic in the same order: bit for bit
constexpr double kElementwise = 2e-6;  // erf/exp/tanh differ by an ulp or two between libm and CUDA
constexpr double kReduction = 1e-5;    // sums in another order (rows, columns, blocks)
constexpr double kGemm = 1e-5;         // cuBLAS FP32 vs Eigen: other blocking, other sum order
// BF16 mixed precision against the FP32 CPU: each BF16 store rounds to 8 mantissa bits (relative error
// up to 2^-9 = 0.2%), and an op's output is a few such roundings of its inputs and of itself.
constexpr double kBf16 = 2e-2;
// Attention with the probabilities' quantizer on inputs BF16 holds exactly: a sum in another order moves a
// probability across a rounding boundary of its quantizer now and then, which moves an output by a step
// (2^-8) times a value of V. In BF16 the output's rounding comes on top: kBf16 there.
constexpr double kAttentionQuantized = 1e-4;
// The fused attention's TF32 kernels against the FP32 CPU: each operand of the products rounded to 10
// mantissa bits (relative error up to 2^-11), sums in FP32.
constexpr double kTf32Attention = 5e-3;
// The same with the probabilities' quantizer: the fused kernels' probabilities (2 to the power of the scaled
// score less the log-sum-exp) differ from the ops' in their last bits, which now and then moves one across a
// rounding boundary of the quantizer: an output then moves by a step (2^-8) times a value of V, up to 1% of
// the largest output.
constexpr double kTf32AttentionQuantized = 1e-2;

struct Result {
  std::vector<float> value;
  std::vector<std::vector<float>> grads;  // one per input (empty when the input takes no gradient)
};

std::vector<float> random_values(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(gen);
  return v;
}

// Runs build on `device` with the inputs as leaves, back-propagates sum(y * upstream) and returns the
// output and every input's gradient, on the host.
Result run_on(const Device& device, const std::vector<Shape>& shapes, const std::vector<std::vector<float>>& inputs,
              const std::vector<bool>& differentiable, const Build& build, uint32_t upstream_seed) {
  // Poison the workspace first: a backward that reads a gradient buffer it should only write (see
  // Graph::grad_target) then picks up NaNs instead of the zeros fresh device memory tends to hold.
  // The pattern is a NaN both as a float and as each of its two BF16 halves.
  constexpr int64_t kPoisoned = int64_t{4} << 20;
  Graph<float> g(device, kPoisoned * sizeof(float));
  const std::vector<uint32_t> nans(static_cast<size_t>(kPoisoned), 0x7FC07FC0u);
  device.copy_to_device(g.scratch<uint32_t>(kPoisoned), nans.data(), nans.size() * sizeof(uint32_t));
  g.clear();
  std::vector<DeviceBuffer> values, grads;
  std::vector<Var> leaves;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const size_t bytes = inputs[i].size() * sizeof(float);
    values.emplace_back(device, bytes);
    grads.emplace_back(device, bytes);
    device.copy_to_device(values.back().data(), inputs[i].data(), bytes);
    device.fill_zero(grads.back().data(), bytes);
    const TensorView<float> v(values.back().as<float>(), shapes[i]);
    leaves.push_back(differentiable[i] ? g.leaf(v, TensorView<float>(grads.back().as<float>(), shapes[i]))
                                       : g.constant(v));
  }
  Var y = build(g, leaves);
  Result r;
  r.value = g.to_host(y);
  const std::vector<float> upstream = random_values(static_cast<int64_t>(r.value.size()), upstream_seed);
  Var loss = ops::sum(g, ops::mul(g, y, g.input(std::span<const float>(upstream), g.shape(y))));
  g.backward(loss);
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<float> grad(differentiable[i] ? inputs[i].size() : 0);
    device.copy_to_host(grad.data(), grads[i].data(), grad.size() * sizeof(float));
    r.grads.push_back(std::move(grad));
  }
  return r;
}

double relative_difference(const std::vector<float>& actual, const std::vector<float>& expected) {
  EXPECT_EQ(actual.size(), expected.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < expected.size() && i < actual.size(); ++i) {
    diff = std::max(diff, std::abs(double(actual[i]) - double(expected[i])));
    scale = std::max(scale, std::abs(double(expected[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Device::cuda_available())
      GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): these tests run on a machine with an NVIDIA GPU";
    gpu_ = Device::cuda(0, Precision::kFp32);
    gpu_bf16_ = Device::cuda(0, Precision::kBf16);
  }
  // Compares the op on both devices: forward within forward_tol, each gradient within backward_tol in
  // FP32; both within bf16_tol in BF16 mixed precision.
  void compare(const std::vector<Shape>& shapes, const Build& build, double forward_tol, double backward_tol,
               std::vector<bool> differentiable = {}, float scale = 1.0f, double bf16_tol = kBf16) {
    if (differentiable.empty()) differentiable.assign(shapes.size(), true);
    std::vector<std::vector<float>> inputs;
    for (size_t i = 0; i < shapes.size(); ++i)
      inputs.push_back(random_values(shapes[i].numel(), 11 + uint32_t(i), scale));
    const Result cpu = run_on(Device::cpu(), shapes, inputs, differentiable, build, 99);
    for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
      const bool bf16 = gpu->precision() == Precision::kBf16;
      SCOPED_TRACE(bf16 ? "bf16" : "fp32");
      const Result r = run_on(*gpu, shapes, inputs, differentiable, build, 99);
      EXPECT_LE(relative_difference(r.value, cpu.value), bf16 ? bf16_tol : forward_tol) << "forward";
      for (size_t i = 0; i < shapes.size(); ++i)
        if (differentiable[i]) {
          EXPECT_LE(relative_difference(r.grads[i], cpu.grads[i]), bf16 ? bf16_tol : backward_tol)
              << "gradient of input " << i;
        }
    }
  }
  std::unique_ptr<Device> gpu_, gpu_bf16_;
};

TEST_F(CudaOps, MatmulEveryTransposeBatchedAndShared) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      SCOPED_TRACE(std::to_string(ta) + std::to_string(tb));
      const Shape a = ta ? Shape{3, 2, 17, 13} : Shape{3, 2, 13, 17};
      const Shape b = tb ? Shape{3, 2, 9, 17} : Shape{3, 2, 17, 9};
      compare(
          {a, b}, [=](Graph<float>& g, const std::vector<Var>& in) { return ops::matmul(g, in[0], in[1], ta, tb); },
          kGemm, kGemm);
      compare(
          {ta ? Shape{17, 13} : Shape{13, 17}, tb ? Shape{9, 17} : Shape{17, 9}},
          [=](Graph<float>& g, const std::vector<Var>& in) { return ops::matmul(g, in[0], in[1], ta, tb); }, kGemm,
          kGemm);
    }
  for (bool tb : {false, true})  // a 2-D b shared by every row of a 3-D a
    compare(
        {Shape{4, 5, 33}, tb ? Shape{7, 33} : Shape{33, 7}},
        [=](Graph<float>& g, const std::vector<Var>& in) { return ops::matmul(g, in[0], in[1], false, tb); }, kGemm,
        kGemm);
}

TEST_F(CudaOps, ScaledMatmulFoldsTheScaleIntoTheGemm) {
  compare(
      {Shape{2, 3, 11, 8}, Shape{2, 3, 11, 8}},
      [](Graph<float>& g, const std::vector<Var>& in) {
        return ops::scaled_matmul(g, in[0], in[1], 0.125, false, true);
      },
      kGemm, kGemm);
}

// Each op's inputs are inner nodes that a second op also reads, recorded before or after it, so the
// op's backward both writes a fresh (poisoned) gradient buffer and adds to one that holds a gradient.
TEST_F(CudaOps, InnerGradientsAreWrittenFreshOrAccumulatedInEitherOrder) {
  const std::vector<int32_t> targets = {3, -1, 0, 9};
  const std::vector<float> scales = {0.05f};
  const std::vector<std::pair<std::vector<Shape>, Build>> cases = {
      {{Shape{2, 5, 6}, Shape{2, 6, 3}},
       [](Graph<float>& g, const std::vector<Var>& in) { return ops::matmul(g, in[0], in[1]); }},
      {{Shape{2, 5, 6}, Shape{2, 7, 6}},
       [](Graph<float>& g, const std::vector<Var>& in) {
         return ops::scaled_matmul(g, in[0], in[1], 0.3, false, true);
       }},
      {{Shape{5, 6}, Shape{4, 6}, Shape{4}},
       [](Graph<float>& g, const std::vector<Var>& in) { return ops::linear(g, in[0], in[1], in[2]); }},
      {{Shape{4, 6}, Shape{4, 6}},
       [](Graph<float>& g, const std::vector<Var>& in) { return ops::add(g, in[0], in[1]); }},
      {{Shape{4, 6}, Shape{4, 6}},  // both operands the same node: the add passes dy through, then adds it again
       [](Graph<float>& g, const std::vector<Var>& in) { return ops::add(g, in[0], ops::add(g, in[1], in[1])); }},
      {{Shape{4, 6}, Shape{6}}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::add(g, in[0], in[1]); }},
      {{Shape{4, 6}, Shape{6, 6}},  // a residual: x + x W, whose product's backward writes x's gradient
       [](Graph<float>& g, const std::vector<Var>& in) { return ops::add(g, in[0], ops::matmul(g, in[0], in[1])); }},
      {{Shape{4, 6}, Shape{4, 6}},
       [](Graph<float>& g, const std::vector<Var>& in) { return ops::mul(g, in[0], in[1]); }},
      {{Shape{4, 6}}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::scale(g, in[0], -1.5); }},
      {{Shape{2, 3, 4, 8}},
       [](Graph<float>& g, const std::vector<Var>& in) {
         return ops::permute(g, in[0], {0, 2, 1, 3});
       }},
      {{Shape{2, 3, 4, 5}},
       [](Graph<float>& g, const std::vector<Var>& in) {
         return ops::permute(g, in[0], {0, 2, 1, 3});
       }},
      {{Shape{4, 6}}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::gelu(g, in[0]); }},
      {{Shape{4, 6}}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::tanh(g, in[0]); }},
      {{Shape{4, 6}}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::softmax(g, in[0]); }},
      {{Shape{4, 6}, Shape{6}, Shape{6}},
       [](Graph<float>& g, const std::vector<Var>& in) { return ops::layer_norm(g, in[0], in[1], in[2], 1e-5); }},
      {{Shape{4, 60}},
       [](Graph<float>& g, const std::vector<Var>& in) {
         Rng rng(7);
         return ops::dropout(g, in[0], 0.3, /*training=*/true, rng);
       }},
      {{Shape{4, 10}},
       [&](Graph<float>& g, const std::vector<Var>& in) { return ops::cross_entropy<float>(g, in[0], targets); }},
      {{Shape{4, 60}},
       [&](Graph<float>& g, const std::vector<Var>& in) {
         return ops::fake_quantize(g, in[0], g.input(std::span<const float>(scales), Shape{1}), -8, 7);
       }},
      {{Shape{4, 6}}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::sum(g, in[0]); }},
      {{Shape{4, 9}},
       [](Graph<float>& g, const std::vector<Var>& in) {
         Var teacher;
         {  // a teacher computed without gradients
           NoGradGuard<float> no_grad(g);
           teacher = ops::scale(g, in[0], 1.7);
         }
         return ops::distillation_loss(g, in[0], teacher, 2.0);
       }},
  };
  for (bool other_first : {false, true})
    for (size_t c = 0; c < cases.size(); ++c) {
      SCOPED_TRACE("case " + std::to_string(c) + (other_first ? ", other reader first" : ", op first"));
      const Build& op = cases[c].second;
      compare(
          cases[c].first,
          [&](Graph<float>& g, const std::vector<Var>& in) {
            std::vector<Var> inner;
            for (Var v : in) inner.push_back(ops::scale(g, v, 0.5));
            Var other = other_first ? ops::sum(g, inner[0]) : Var{};
            Var y = op(g, inner);
            for (size_t i = other_first ? 1 : 0; i < inner.size(); ++i)
              other = other.valid() ? ops::add(g, other, ops::sum(g, inner[i])) : ops::sum(g, inner[i]);
            return ops::add(g, y, other);
          },
          kGemm, kGemm, {}, 2.0f);
    }
}

TEST_F(CudaOps, LinearWithAndWithoutBias) {
  compare(
      {Shape{3, 5, 24}, Shape{10, 24}, Shape{10}},
      [](Graph<float>& g, const std::vector<Var>& in) { return ops::linear(g, in[0], in[1], in[2]); }, kGemm, kGemm);
  compare(
      {Shape{7, 3}, Shape{5, 3}},
      [](Graph<float>& g, const std::vector<Var>& in) { return ops::linear(g, in[0], in[1], Var{}); }, kGemm, kGemm);
  // A large output whose width is not a multiple of 4 (a vocabulary): computed through padded rows.
  compare(
      {Shape{300, 24}, Shape{3501, 24}, Shape{3501}},
      [](Graph<float>& g, const std::vector<Var>& in) { return ops::linear(g, in[0], in[1], in[2]); }, kGemm, kGemm);
  compare(  // an even width that is not a multiple of 4 (30,522): the bias sums two columns a thread
      {Shape{300, 24}, Shape{3502, 24}, Shape{3502}},
      [](Graph<float>& g, const std::vector<Var>& in) { return ops::linear(g, in[0], in[1], in[2]); }, kGemm, kGemm);
  compare(
      {Shape{300, 24}, Shape{3501, 24}},
      [](Graph<float>& g, const std::vector<Var>& in) { return ops::linear(g, in[0], in[1], Var{}); }, kGemm, kGemm);
  // An odd width with more column groups than the context has arrival counters (4,376 of 32): the column
  // sums' partials added by a second kernel.
  compare(
      {Shape{70, 24}, Shape{140001, 24}, Shape{140001}},
      [](Graph<float>& g, const std::vector<Var>& in) { return ops::linear(g, in[0], in[1], in[2]); }, kGemm, kGemm);
  // The bias gradient's column sums over many row chunks, 4 columns a thread, added into by a second use;
  // then over 126 chunks of 71 rows and a short one (more rows than 128 chunks of 64 hold).
  compare(
      {Shape{9001, 8}, Shape{36, 8}, Shape{36}},
      [](Graph<float>& g, const std::vector<Var>& in) { return ops::linear(g, in[0], in[1], in[2]); }, kGemm, kGemm);
  compare(
      {Shape{2, 700, 24}, Shape{64, 24}, Shape{64}},
      [](Graph<float>& g, const std::vector<Var>& in) {
        Var y = ops::linear(g, in[0], in[1], in[2]);
        return ops::add(g, y, ops::linear(g, ops::scale(g, in[0], 0.5), in[1], in[2]));
      },
      kGemm, kGemm);
}

#if BERT_WITH_CUDA
// Each cuBLASLt product's algorithm is tuned at its first run (core/cuda/lt_plans.h) among the candidates
// whose result is the heuristic's first choice's bit for bit on that run's operands. A linear at a
// BERT-base feed-forward shape (its bias in the epilogue, the input's and the weight's gradients: the three
// kinds of product of a training step), and the batched product of the Q, K and V projections, forward
// and backward on a device that tunes and on one that keeps the heuristic's choice: the same bits, on the
// operands tuned on and on others, in each precision.
TEST_F(CudaOps, GemmTuningKeepsTheHeuristicsBits) {
  const std::vector<Shape> linear = {Shape{8, 512, 768}, Shape{3072, 768}, Shape{3072}};
  const Build feed_forward = [](Graph<float>& g, const std::vector<Var>& in) {
    return ops::linear(g, in[0], in[1], in[2]);
  };
  const std::vector<Shape> batched = {Shape{3, 4096, 768}, Shape{3, 768, 768}};
  const Build projections = [](Graph<float>& g, const std::vector<Var>& in) {
    return ops::matmul(g, in[0], in[1], false, true);
  };
  for (const Precision precision : {Precision::kBf16, Precision::kTf32, Precision::kFp32}) {
    SCOPED_TRACE(precision_name(precision));
    const std::unique_ptr<Device> tuned = Device::cuda(0, precision), plain = Device::cuda(0, precision);
    plain->cuda_context()->lt_plans->tune = false;
    for (const auto& [shapes, build] : {std::pair{linear, feed_forward}, std::pair{batched, projections}})
      for (const uint32_t seed : {1u, 2u}) {  // the first run tunes; the second multiplies other operands
        SCOPED_TRACE(seed);
        std::vector<std::vector<float>> inputs;
        for (size_t i = 0; i < shapes.size(); ++i)
          inputs.push_back(random_values(shapes[i].numel(), seed * 10 + uint32_t(i), 0.5f));
        const std::vector<bool> differentiable(shapes.size(), true);
        const Result a = run_on(*tuned, shapes, inputs, differentiable, build, seed + 90);
        const Result b = run_on(*plain, shapes, inputs, differentiable, build, seed + 90);
        EXPECT_TRUE(a.value == b.value) << "forward";
        for (size_t i = 0; i < shapes.size(); ++i) EXPECT_TRUE(a.grads[i] == b.grads[i]) << "gradient of input " << i;
      }
    const GemmTuning summary = summarize_tuning(*tuned->cuda_context());
    EXPECT_GE(summary.tuned, 1);
    EXPECT_EQ(summarize_tuning(*plain->cuda_context()).tuned, 0);
    EXPECT_LE(summary.chosen_us, summary.first_us);
    std::printf("  %s %s\n", precision_name(precision).c_str(), summary.describe().c_str());
  }
}
#endif

TEST_F(CudaOps, AddAndMulWithBroadcasting) {
  const std::vector<std::pair<Shape, Shape>> cases = {{{4, 6, 8}, {4, 6, 8}},    {{4, 6, 8}, {6, 8}},
                                                      {{4, 6, 8}, {8}},          {{4, 1, 8}, {4, 6, 1}},
                                                      {{2, 3, 5, 7}, {3, 1, 7}}, {{5}, {1}},
                                                      {{5, 7}, {3, 5, 7}},       {{3, 5, 7}, {1, 5, 7}}};
  for (const auto& [a, b] : cases) {
    SCOPED_TRACE(a.str() + " " + b.str());
    compare(
        {a, b}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::add(g, in[0], in[1]); }, kExact,
        kReduction);
    compare(
        {a, b}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::mul(g, in[0], in[1]); }, kExact,
        kReduction);
  }
}

TEST_F(CudaOps, ScaleReshapePermuteTranspose) {
  compare(
      {Shape{3, 7}}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::scale(g, in[0], -0.37); }, kExact,
      kExact);
  compare(
      {Shape{6, 10}},
      [](Graph<float>& g, const std::vector<Var>& in) {
        return ops::reshape(g, in[0], Shape{3, 4, 5});
      },
      kExact, kExact);
  compare(
      {Shape{2, 3, 5, 7}},
      [](Graph<float>& g, const std::vector<Var>& in) {
        return ops::permute(g, in[0], {0, 2, 1, 3});
      },
      kExact, kExact);
  compare(
      {Shape{2, 3, 5, 7}},
      [](Graph<float>& g, const std::vector<Var>& in) {
        return ops::permute(g, in[0], {3, 1, 0, 2});
      },
      kExact, kExact);
  compare(
      {Shape{9, 4}}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::transpose(g, in[0], 0, 1); }, kExact,
      kExact);
}

TEST_F(CudaOps, GatherRowsWithRepeatedIds) {
  const std::vector<int32_t> ids = {3, 0, 3, 7, 1, 3, 0, 8, 8, 2, 5, 3};
  compare(
      {Shape{9, 13}},
      [&](Graph<float>& g, const std::vector<Var>& in) {
        return ops::gather_rows(g, in[0], ids, Shape{3, 4});
      },
      kExact, kReduction);
  compare(
      {Shape{9, 13}},
      [&](Graph<float>& g, const std::vector<Var>& in) {
        return ops::gather_rows(g, in[0], std::span<const int32_t>(ids).first(1), Shape{});
      },
      kExact, kExact);
  // The backward's grouping (made on the host): a padding-like id repeated 1,000 times (16 chunks of 64), two ids
  // of 130 (3 chunks each), the rest scattered over a 3,000-row table; and a 2-row table (token types).
  std::vector<int32_t> many(1000, 0);
  for (int32_t id : {1, 2})
    for (int i = 0; i < 130; ++i) many.insert(many.begin() + (i * 7 + id) % int(many.size()), id);
  std::mt19937 gen(5);
  while (many.size() < 4100) many.push_back(int32_t(gen() % 3000));
  std::shuffle(many.begin(), many.end(), gen);
  const Build gather_many = [&](Graph<float>& g, const std::vector<Var>& in) {
    return ops::gather_rows(g, in[0], many, Shape{41, 100});
  };
  compare({Shape{3000, 24}}, gather_many, kExact, kReduction);
  std::vector<int32_t> types(700);
  for (size_t i = 0; i < types.size(); ++i) types[i] = int32_t(gen() % 2);
  compare(
      {Shape{2, 24}},
      [&](Graph<float>& g, const std::vector<Var>& in) {
        return ops::gather_rows(g, in[0], types, Shape{7, 100});
      },
      kExact, kReduction);
  // The same gradient on every run (no atomics in the sums).
  const std::vector<std::vector<float>> table = {random_values(3000 * 24, 3)};
  const Result first = run_on(*gpu_, {Shape{3000, 24}}, table, {true}, gather_many, 7);
  const Result second = run_on(*gpu_, {Shape{3000, 24}}, table, {true}, gather_many, 7);
  EXPECT_EQ(first.grads[0], second.grads[0]);
}

TEST_F(CudaOps, GeluAndTanh) {
  compare(
      {Shape{5, 333}}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::gelu(g, in[0]); }, kElementwise,
      kElementwise, {}, 3.0f);
  compare(
      {Shape{5, 333}}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::tanh(g, in[0]); }, kElementwise,
      kElementwise, {}, 2.0f);
}

TEST_F(CudaOps, SoftmaxWithAndWithoutMask) {
  compare(
      {Shape{3, 2, 5, 37}}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::softmax(g, in[0]); },
      kElementwise, kReduction, {}, 3.0f);
  std::vector<float> mask(3 * 37, 0.0f);
  for (int i = 30; i < 37; ++i) mask[i] = mask[2 * 37 + i - 20] = -10000.0f;
  compare(
      {Shape{3, 2, 5, 37}},
      [&](Graph<float>& g, const std::vector<Var>& in) {
        return ops::softmax(g, in[0], g.input(std::span<const float>(mask), Shape{3, 37}));
      },
      kElementwise, kReduction, {}, 3.0f);
  // Rows held in registers (a multiple of 4, up to 1024) and one longer (the one-pass-per-element kernel).
  for (const Shape& s : {Shape{4, 700}, Shape{6, 128}, Shape{2, 1024}, Shape{2, 1028}})
    compare(
        {s}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::softmax(g, in[0]); }, kElementwise,
        kReduction);
}

TEST_F(CudaOps, LayerNormOddWidthsAndManyRows) {
  // 9,001 rows: blocks of 24 rows (more than 512 blocks of 16), the last one ragged.
  for (const Shape& x :
       {Shape{3, 7, 45}, Shape{600, 64}, Shape{2, 1000}, Shape{700, 1024}, Shape{3, 1028}, Shape{9001, 32}}) {
    SCOPED_TRACE(x.str());
    compare(
        {x, Shape{x.last()}, Shape{x.last()}},
        [](Graph<float>& g, const std::vector<Var>& in) { return ops::layer_norm(g, in[0], in[1], in[2], 1e-12); },
        kReduction, kReduction);
  }
}

// LayerNorm of a residual sum in one kernel each way (rows in registers: widths a multiple of 4 up to 1024)
// against the CPU, every input's gradient, one of them also added to by a second use; a width the kernels
// do not hold (45) and one sum of a node with itself take the add and LayerNorm ops. 768 and 1,024 fill
// their chunks (the kernels compiled for full rows), 64 does not (the bounds tests).
TEST_F(CudaOps, AddLayerNormFusedAndNot) {
  for (const Shape& x : {Shape{3, 7, 64}, Shape{600, 768}, Shape{5, 1024}, Shape{3, 7, 45}, Shape{4, 1100}}) {
    SCOPED_TRACE(x.str());
    compare(
        {x, x, Shape{x.last()}, Shape{x.last()}},
        [](Graph<float>& g, const std::vector<Var>& in) {
          Var y = ops::add_layer_norm(g, in[0], in[1], in[2], in[3], 1e-12);
          return ops::add(g, y, ops::scale(g, in[1], 0.5));  // b's gradient accumulates
        },
        kReduction, kReduction);
  }
  compare(
      {Shape{6, 128}, Shape{128}, Shape{128}},
      [](Graph<float>& g, const std::vector<Var>& in) {
        return ops::add_layer_norm(g, in[0], in[0], in[1], in[2], 1e-12);
      },
      kReduction, kReduction);
}

// Dropout, the residual add and LayerNorm in one kernel each way: the CPU's dropout then add_layer_norm
// (the same draws), every input's gradient, the residual's also added to by a second use; a width the
// register kernels do not hold (45) runs the two ops; not training or p = 0 is add_layer_norm.
TEST_F(CudaOps, DropoutAddLayerNormFusedAndNot) {
  for (const Shape& x : {Shape{3, 7, 64}, Shape{600, 768}, Shape{5, 1024}, Shape{3, 7, 45}}) {
    for (double p : {0.1, 0.5}) {
      SCOPED_TRACE(x.str() + " p " + std::to_string(p));
      compare(
          {x, x, Shape{x.last()}, Shape{x.last()}},
          [p](Graph<float>& g, const std::vector<Var>& in) {
            Rng rng(21);
            Var y = ops::dropout_add_layer_norm(g, in[0], in[1], in[2], in[3], 1e-12, p, /*training=*/true, rng);
            return ops::add(g, y, ops::scale(g, in[1], 0.5));  // b's gradient accumulates
          },
          kReduction, kReduction);
    }
  }
  compare(
      {Shape{4, 128}, Shape{4, 128}, Shape{128}, Shape{128}},
      [](Graph<float>& g, const std::vector<Var>& in) {
        Rng rng(21);
        return ops::dropout_add_layer_norm(g, in[0], in[1], in[2], in[3], 1e-12, 0.1, /*training=*/false, rng);
      },
      kReduction, kReduction);
}

// dropout_add_layer_norm in FP32 keeps no copy of the sum it normalised: its backward forms the sum again
// from the addends the graph keeps (and the dropout's kept bits), so what the op adds to the workspace is
// its output, the rows' statistics and the bits (BF16 keeps the sum). The values it gives are held to the
// CPU's by DropoutAddLayerNormFusedAndNot.
TEST_F(CudaOps, DropoutAddLayerNormKeepsNoSumForItsBackwardInFp32) {
  for (const Shape& x : {Shape{600, 768}, Shape{5, 40, 1024}}) {
    SCOPED_TRACE(x.str());
    size_t kept = 0;
    const Result r = run_on(
        *gpu_, {x, x, Shape{x.last()}, Shape{x.last()}},
        {random_values(x.numel(), 31), random_values(x.numel(), 32), random_values(x.last(), 33),
         random_values(x.last(), 34)},
        {true, true, true, true},
        [&](Graph<float>& g, const std::vector<Var>& in) {
          Rng rng(21);
          const size_t before = g.workspace().bytes_in_use();
          const Var y = ops::dropout_add_layer_norm(g, in[0], in[1], in[2], in[3], 1e-12, 0.1, true, rng);
          kept = g.workspace().bytes_in_use() - before;
          return y;
        },
        23);
    const size_t output = static_cast<size_t>(x.numel()) * sizeof(float), rows = static_cast<size_t>(x.rows());
    EXPECT_LT(kept, output + rows * (128 + 8) + 4096) << "a copy of the sum kept (beside the output, the bits, "
                                                         "mean and rstd)";
    for (const auto& grad : r.grads)
      for (const float v : grad) ASSERT_TRUE(std::isfinite(v));
  }
}

// A linear (or the feed-forward block) read only by dropout_add_layer_norm: its bias gradient is summed in
// the LayerNorm's backward from the gradient it writes (Graph::bias_to_sum), not by a pass of the linear's
// own; against the CPU, which sums it in the linear. With a second reader of the linear's output the linear
// sums it itself; rows the LayerNorm kernels do not take (45 wide) leave it to the linear too.
TEST_F(CudaOps, LinearBiasGradientSummedByTheLayerNormReadingIt) {
  for (const int64_t c : {int64_t{128}, int64_t{768}, int64_t{45}}) {
    for (bool second_reader : {false, true}) {
      SCOPED_TRACE("width " + std::to_string(c) + (second_reader ? ", a second reader" : ""));
      compare(
          {Shape{3, 50, 40}, Shape{c, 40}, Shape{c}, Shape{3, 50, c}, Shape{c}, Shape{c}},
          [second_reader](Graph<float>& g, const std::vector<Var>& in) {
            Rng rng(21);
            const Var a = ops::linear(g, in[0], in[1], in[2]);
            Var y = ops::dropout_add_layer_norm(g, a, in[3], in[4], in[5], 1e-12, 0.1, /*training=*/true, rng);
            return second_reader ? ops::add(g, y, ops::scale(g, a, 0.5)) : y;
          },
          kReduction, kReduction);
    }
  }
  compare(
      {Shape{2, 30, 64}, Shape{256, 64}, Shape{256}, Shape{64, 256}, Shape{64}, Shape{64}, Shape{64}},
      [](Graph<float>& g, const std::vector<Var>& in) {
        Rng rng(22);
        const Var ff = ops::feed_forward(g, in[0], in[1], in[2], in[3], in[4]);
        return ops::dropout_add_layer_norm(g, ff, in[0], in[5], in[6], 1e-12, 0.1, /*training=*/true, rng);
      },
      kReduction, kReduction);
}

TEST_F(CudaOps, DropoutDropsTheSameElementsAsTheCpu) {
  for (double p : {0.1, 0.5}) {
    compare(
        {Shape{7, 1001}},
        [p](Graph<float>& g, const std::vector<Var>& in) {
          Rng rng(1234);
          rng.reserve(17);  // a stream that has been used before
          return ops::dropout(g, in[0], p, /*training=*/true, rng);
        },
        kExact, kExact);
  }
}

// softmax and dropout fused (one kernel each way) against the two ops on the CPU: rows the register
// kernels hold (a multiple of 4 up to 1024; masked and not) and rows they do not (37 wide, 1100 wide),
// which take the two ops on the GPU too. The draws are the CPU dropout's, element for element.
TEST_F(CudaOps, SoftmaxDropoutGivesSoftmaxThenDropout) {
  for (const Shape& s : {Shape{2, 3, 8, 128}, Shape{3, 2, 5, 36}, Shape{2, 1, 3, 1024}, Shape{2, 2, 5, 37},
                         Shape{2, 1, 2, 1100}})
    for (bool masked : {false, true}) {
      SCOPED_TRACE(s.str() + (masked ? ", masked" : ""));
      std::vector<float> mask(static_cast<size_t>(s[0] * s.last()), 0.0f);
      if (masked)
        for (int64_t j = s.last() / 2; j < s.last(); ++j) mask[(s[0] - 1) * s.last() + j] = -10000.0f;
      compare(
          {s},
          [&](Graph<float>& g, const std::vector<Var>& in) {
            Rng rng(4321);
            rng.reserve(3);
            Var m = masked ? g.input(std::span<const float>(mask), Shape{s[0], s.last()}) : Var{};
            return ops::softmax_dropout(g, in[0], m, 0.2, /*training=*/true, rng);
          },
          // BF16: scores up to about 10 stored in BF16 move their exponentials by up to 10 x 2^-9.
          kElementwise, kReduction, {}, 3.0f, 4e-2);
    }
}

// Attention's two products on the projections in place (batched GEMMs over every item and head) against
// the permutes and products they replace, run on the CPU; odd lengths and head sizes, a gradient added
// into by a second use.
TEST_F(CudaOps, HeadProductsGiveThePermutedProducts) {
  struct Case {
    int64_t b, t, h, d;
  };
  for (const Case c : {Case{2, 7, 3, 5}, Case{3, 16, 2, 8}, Case{1, 33, 4, 16}}) {
    SCOPED_TRACE("B " + std::to_string(c.b) + " T " + std::to_string(c.t) + " H " + std::to_string(c.h) + " D " +
                 std::to_string(c.d));
    const Shape s{c.b, c.t, c.h * c.d}, square{c.b, c.h, c.t, c.t};
    compare(
        {s, s},
        [&](Graph<float>& g, const std::vector<Var>& in) {
          Var scores = ops::head_scores(g, in[0], in[1], c.h, 0.37);
          return ops::add(g, scores, ops::head_scores(g, in[0], in[0], c.h, 1.0));  // q's gradient twice
        },
        kGemm, 2 * kGemm);
    compare(
        {square, s},
        [&](Graph<float>& g, const std::vector<Var>& in) {
          Var context = ops::head_context(g, in[0], in[1], c.h);
          return ops::add(g, context, ops::head_context(g, in[0], in[1], c.h));  // both gradients twice
        },
        kGemm, 2 * kGemm);
  }
}

// The unfused attention's core (scores, softmax with dropout and a padding mask, context) recomputed in the
// backward (ops::recompute, as FP32 and TF32 steps run it with --attention recompute), and with the scores
// transient (ops::head_scores' `transient`, as the unfused attention runs them): the same bits as the ops
// kept, values and the gradients of q, k and v, the same draws (the softmax's backward draws the dropout
// again); the recomputed graph keeps the context only, the transient scores take no workspace. A BF16 step's
// tensors are refused by the recompute.
TEST_F(CudaOps, RecomputedAttentionCoreEqualsTheKeptOps) {
  const int64_t b = 3, t = 37, heads = 4, d = 16, c = heads * d;
  std::vector<float> mask(static_cast<size_t>(b * t), 0.0f);
  for (int64_t j = 30; j < t; ++j) mask[static_cast<size_t>(2 * t + j)] = -10000.0f;  // the last item padded
  bool transient = false;
  const auto core = [&](Graph<float>& g, std::span<const Var> in, Rng& rng) {
    const Var scores = ops::head_scores(g, in[0], in[1], heads, 0.25, transient);
    return ops::head_context(g, ops::softmax_dropout(g, scores, in[3], 0.1, true, rng), in[2], heads);
  };
  auto run = [&](const Device& device, bool recomputed, size_t* kept) {
    return run_on(
        device, {Shape{b, t, c}, Shape{b, t, c}, Shape{b, t, c}},
        {random_values(b * t * c, 61, 0.5f), random_values(b * t * c, 62, 0.5f), random_values(b * t * c, 63, 0.5f)},
        {true, true, true},
        [&](Graph<float>& g, const std::vector<Var>& in) {
          Rng rng(5);
          std::vector<Var> inputs = {ops::scale(g, in[0], 1.0), in[1], in[2],
                                     g.input(std::span<const float>(mask), Shape{b, t})};
          const size_t before = g.workspace().bytes_in_use();
          const Var y = recomputed ? ops::recompute<float>(g, inputs, rng, core) : core(g, inputs, rng);
          *kept = g.workspace().bytes_in_use() - before;
          return ops::add(g, y, inputs[0]);  // q's gradient added to
        },
        17);
  };
  size_t kept_direct = 0, kept_recomputed = 0;
  const Result direct = run(*gpu_, false, &kept_direct), again = run(*gpu_, true, &kept_recomputed);
  EXPECT_LE(relative_difference(again.value, direct.value), kExact);
  for (size_t i = 0; i < 3; ++i) EXPECT_LE(relative_difference(again.grads[i], direct.grads[i]), kExact) << i;
  const size_t square = static_cast<size_t>(b * heads * t * t) * sizeof(float);
  EXPECT_LE(kept_recomputed + 2 * square, kept_direct);  // at least the scores and probabilities not kept
  transient = true;
  size_t kept_transient = 0;
  const Result scores_transient = run(*gpu_, false, &kept_transient);
  EXPECT_EQ(scores_transient.value, direct.value);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(scores_transient.grads[i], direct.grads[i]) << i;
  EXPECT_GE(kept_direct, kept_transient + square);
  EXPECT_LE(kept_recomputed + square, kept_transient);  // the recomputation keeps neither of the two left
  transient = false;
  size_t unused = 0;
  EXPECT_THROW(run(*gpu_bf16_, true, &unused), std::exception);
}

// softmax_dropout_context (the dropped-out probabilities in transient memory, formed again in the backward)
// against head_context over softmax_dropout kept: the same bits, values and the gradients of q, k and v, in
// FP32 and BF16, masked, with a length the one-kernel softmax holds (36) and one it does not (37: the kept
// ops run). The transient slot is overwritten with NaNs between the forward and the backward, so a backward
// that read what the forward left there would not give the kept ops' gradients.
TEST_F(CudaOps, SoftmaxDropoutContextFormsTheDroppedProbabilitiesAgain) {
  for (const int64_t t : {36, 37})
    for (const Device* device : {gpu_.get(), gpu_bf16_.get()}) {
      SCOPED_TRACE("T " + std::to_string(t) + (device == gpu_bf16_.get() ? ", bf16" : ", fp32"));
      const int64_t b = 3, heads = 4, d = 16, c = heads * d;
      std::vector<float> mask(static_cast<size_t>(b * t), 0.0f);
      for (int64_t j = 30; j < t; ++j) mask[static_cast<size_t>(2 * t + j)] = -10000.0f;  // the last item padded
      const int64_t square = b * heads * t * t;
      const std::vector<uint32_t> nans(static_cast<size_t>(square), 0x7FC07FC0u);
      auto run = [&](bool again, size_t* kept) {
        return run_on(
            *device, {Shape{b, t, c}, Shape{b, t, c}, Shape{b, t, c}},
            {random_values(b * t * c, 71, 0.5f), random_values(b * t * c, 72, 0.5f),
             random_values(b * t * c, 73, 0.5f)},
            {true, true, true},
            [&](Graph<float>& g, const std::vector<Var>& in) {
              Rng rng(9);
              rng.reserve(7);
              const Var m = g.input(std::span<const float>(mask), Shape{b, t});
              const size_t before = g.workspace().bytes_in_use();
              const Var scores = ops::head_scores(g, in[0], in[1], heads, 0.25, /*transient=*/true);
              const Var y =
                  again ? ops::softmax_dropout_context(g, scores, m, in[2], heads, 0.1, true, rng)
                        : ops::head_context(g, ops::softmax_dropout(g, scores, m, 0.1, true, rng), in[2], heads);
              *kept = g.workspace().bytes_in_use() - before;
              g.device().copy_to_device(g.transient<uint32_t>(1, nans.size()), nans.data(),
                                        nans.size() * sizeof(uint32_t));
              return ops::add(g, y, in[0]);
            },
            19);
      };
      size_t kept_ops = 0, kept_again = 0;
      const Result ops_kept = run(false, &kept_ops), formed_again = run(true, &kept_again);
      EXPECT_EQ(formed_again.value, ops_kept.value);
      for (size_t i = 0; i < 3; ++i) EXPECT_EQ(formed_again.grads[i], ops_kept.grads[i]) << i;
      const size_t bytes = static_cast<size_t>(square) * (device == gpu_bf16_.get() ? 2 : 4);
      if (t % 4 == 0) {
        EXPECT_LE(kept_again + bytes, kept_ops) << "the dropped-out probabilities not kept";
      } else {
        EXPECT_EQ(kept_again, kept_ops) << "the kept ops where the one-kernel softmax does not run";
      }
      for (const float v : formed_again.value) ASSERT_TRUE(std::isfinite(v));
    }
}

// Fused attention (one kernel forward, one or two backward) against the ops it replaces, run on the CPU:
// head sizes 16 to 128, lengths from 7 (one partial key tile) to 512, with and without a padding mask, and
// with dropout (the same draws as the unfused dropout, so the values still agree element for element). In
// BF16 the backward is one kernel up to length 128 and head size 64 (7 to 128 here), two beyond (200, 512).
TEST_F(CudaOps, FusedAttentionGivesTheComposedOps) {
  struct Case {
    int64_t b, h, t, d;
  };
  for (const Case c : {Case{2, 3, 7, 16}, Case{2, 2, 64, 32}, Case{2, 3, 65, 32}, Case{3, 2, 100, 64},
                       Case{2, 2, 128, 64}, Case{1, 2, 200, 128}, Case{1, 1, 512, 64}})
    for (bool masked : {false, true})
      for (double p : {0.0, 0.1}) {
        SCOPED_TRACE("B " + std::to_string(c.b) + " H " + std::to_string(c.h) + " T " + std::to_string(c.t) + " D " +
                     std::to_string(c.d) + (masked ? ", masked" : "") + ", dropout " + std::to_string(p));
        for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
          Graph<float> probe(*gpu);
          ASSERT_TRUE(ops::fused_attention(probe, c.d, c.t)) << "the fused kernels cover this shape";
        }
        std::vector<float> mask(static_cast<size_t>(c.b * c.t), 0.0f);
        if (masked)  // the last item padded from 60% of its length, the first untouched
          for (int64_t i = c.t * 6 / 10; i < c.t; ++i) mask[(c.b - 1) * c.t + i] = -10000.0f;
        const Shape s{c.b, c.t, c.h * c.d};
        const double alpha = 1.0 / std::sqrt(double(c.d));
        compare(
            {s, s, s},
            [&](Graph<float>& g, const std::vector<Var>& in) {
              Rng rng(77);
              rng.reserve(5);
              Var m = masked ? g.input(std::span<const float>(mask), Shape{c.b, c.t}) : Var{};
              return ops::attention(g, in[0], in[1], in[2], m, c.h, alpha, p, /*training=*/true, rng);
            },
            kGemm, 2 * kGemm, {}, 1.5f);
      }
}

// The same on the TF32 tensor-core kernels (a TF32 step): head sizes 16 to 128, lengths 7 to 512, masked,
// dropout; the probabilities' quantizer runs in them too (fused_quantized_attention).
TEST_F(CudaOps, FusedAttentionOnTf32TensorCoresGivesTheComposedOps) {
  struct Case {
    int64_t b, h, t, d;
  };
  const std::unique_ptr<Device> tf32 = Device::cuda(0, Precision::kTf32);
  for (const Case c : {Case{2, 3, 7, 16}, Case{2, 2, 64, 32}, Case{3, 2, 100, 64}, Case{2, 2, 128, 64},
                       Case{1, 2, 200, 128}, Case{1, 1, 512, 64}})
    for (bool masked : {false, true})
      for (double p : {0.0, 0.1}) {
        SCOPED_TRACE("B " + std::to_string(c.b) + " H " + std::to_string(c.h) + " T " + std::to_string(c.t) + " D " +
                     std::to_string(c.d) + (masked ? ", masked" : "") + ", dropout " + std::to_string(p));
        Graph<float> probe(*tf32), probe_fp32(*gpu_);
        ASSERT_TRUE(ops::fused_attention(probe, c.d, c.t));
        ASSERT_TRUE(ops::fused_quantized_attention(probe, c.d, c.t)) << "the tensor-core kernels run in TF32";
        EXPECT_FALSE(ops::fused_quantized_attention(probe_fp32, c.d, c.t)) << "FP32 keeps its FP32 kernels";
        std::vector<float> mask(static_cast<size_t>(c.b * c.t), 0.0f);
        if (masked)
          for (int64_t i = c.t * 6 / 10; i < c.t; ++i) mask[(c.b - 1) * c.t + i] = -10000.0f;
        const Shape s{c.b, c.t, c.h * c.d};
        const Build build = [&](Graph<float>& g, const std::vector<Var>& in) {
          Rng rng(77);
          rng.reserve(5);
          Var m = masked ? g.input(std::span<const float>(mask), Shape{c.b, c.t}) : Var{};
          return ops::attention(g, in[0], in[1], in[2], m, c.h, 1.0 / std::sqrt(double(c.d)), p, /*training=*/true,
                                rng);
        };
        std::vector<std::vector<float>> inputs;
        for (uint32_t i = 0; i < 3; ++i) inputs.push_back(random_values(s.numel(), 11 + i, 1.5f));
        const Result cpu = run_on(Device::cpu(), {s, s, s}, inputs, {true, true, true}, build, 99);
        const Result r = run_on(*tf32, {s, s, s}, inputs, {true, true, true}, build, 99);
        EXPECT_LE(relative_difference(r.value, cpu.value), kTf32Attention) << "forward";
        for (size_t i = 0; i < 3; ++i)
          EXPECT_LE(relative_difference(r.grads[i], cpu.grads[i]), kTf32Attention) << "gradient of input " << i;
      }
}

// self_attention: attention on three linears of one input, from separate buffers, against the CPU's
// composition of those ops, masked and with dropout; on the GPU the fused kernels read Q, K and V side by
// side (rows 3C apart) and write the output with rows C apart.
TEST_F(CudaOps, SelfAttentionIsAttentionOnThreeLinears) {
  struct Case {
    int64_t b, h, t, d;
  };
  for (const Case c : {Case{2, 3, 7, 16}, Case{2, 2, 64, 32}, Case{3, 2, 100, 64}, Case{2, 2, 128, 64},
                       Case{1, 2, 200, 128}})
    for (bool masked : {false, true})
      for (double p : {0.0, 0.1}) {
        SCOPED_TRACE("B " + std::to_string(c.b) + " H " + std::to_string(c.h) + " T " + std::to_string(c.t) + " D " +
                     std::to_string(c.d) + (masked ? ", masked" : "") + ", dropout " + std::to_string(p));
        std::vector<float> mask(static_cast<size_t>(c.b * c.t), 0.0f);
        if (masked)
          for (int64_t i = c.t * 6 / 10; i < c.t; ++i) mask[(c.b - 1) * c.t + i] = -10000.0f;
        const int64_t width = c.h * c.d;
        const Shape x{c.b, c.t, width}, w{width, width}, bias{width};
        const double alpha = 1.0 / std::sqrt(double(c.d));
        compare(
            {x, w, bias, w, bias, w, bias},
            [&](Graph<float>& g, const std::vector<Var>& in) {
              Rng rng(77);
              rng.reserve(5);
              Var m = masked ? g.input(std::span<const float>(mask), Shape{c.b, c.t}) : Var{};
              // Q from inputs 1-2, K from 5-6, V from 3-4: F32 weights not equally spaced (three products).
              return ops::self_attention(g, in[0], {in[1], in[5], in[3]}, {in[2], in[6], in[4]}, m, c.h, alpha, p,
                                         /*training=*/true, rng);
            },
            // The key projection's bias (input 6) takes no gradient (a constant added to every key's score
            // leaves the softmax as it is): its gradient is rounding noise, so it is held constant here.
            kGemm, 4 * kGemm, {true, true, true, true, true, true, false}, 0.3f);
      }
}

// The same with the weights and biases in a ParameterArena: weight, bias and a per-channel scale for each
// projection (equally spaced: the projections run as one batched GEMM each way, the bias gradients as one
// column sum), and as the model declares them (Linear::declare_side_by_side: the three weights, then the
// biases, then the scales: x's gradient reads the weights in place, theirs is one GEMM). Against the same
// parameters through three linears and attention on the same GPU, then again adding into the gradients (a
// second micro-batch).
// Lengths 64, 128 and 100 (one and two tiles of keys, and padded): in BF16 the one-kernel backward sums the
// projections' bias gradients as it writes dQ, dK and dV.
TEST_F(CudaOps, SelfAttentionBatchesTheProjectionsOfEquallySpacedParameters) {
  for (const int64_t t : {64, 128, 100}) {
    const int64_t b = 2, h = 4, d = 32, c = h * d;
    const double alpha = 1.0 / std::sqrt(double(d));
    const std::vector<float> x_values = random_values(b * t * c, 3);
    const std::vector<float> upstream = random_values(b * t * c, 4);
    for (const auto& [gpu, side_by_side] : {std::pair{gpu_.get(), false}, std::pair{gpu_bf16_.get(), false},
                                            std::pair{gpu_.get(), true}, std::pair{gpu_bf16_.get(), true}}) {
      SCOPED_TRACE(gpu->name() + (side_by_side ? ", side by side" : ", interleaved") + ", T " + std::to_string(t));
      ParameterArena<float> params;
      std::array<ParamId, 3> w{}, bias{};
      const std::string names[3] = {"q", "k", "v"};
      for (int i = 0; i < 3; ++i) {
        w[i] = params.add(names[i] + ".weight", Shape{c, c});
        if (side_by_side) continue;
        bias[i] = params.add(names[i] + ".bias", Shape{c});
        params.add(names[i] + ".scale", Shape{c});
      }
      if (side_by_side) {
        for (int i = 0; i < 3; ++i) bias[i] = params.add(names[i] + ".bias", Shape{c});
        for (int i = 0; i < 3; ++i) params.add(names[i] + ".scale", Shape{c});
        ASSERT_EQ(params.offset(w[1]) - params.offset(w[0]), c * c);
      }
      params.allocate();
      for (int i = 0; i < 3; ++i) {
        const std::vector<float> wv = random_values(c * c, 10 + i, 0.2f), bv = random_values(c, 20 + i, 0.2f);
        std::copy(wv.begin(), wv.end(), params.get(w[i]).value.data());
        std::copy(bv.begin(), bv.end(), params.get(bias[i]).value.data());
      }
      params.place_on(*gpu);
      struct Run {
        std::vector<float> y, dx, grads;
      };
      auto run = [&](bool batched) {
        params.zero_grad();
        DeviceBuffer xv(*gpu, x_values.size() * 4), dx(*gpu, x_values.size() * 4);
        gpu->copy_to_device(xv.data(), x_values.data(), x_values.size() * 4);
        gpu->fill_zero(dx.data(), dx.bytes());
        Run r;
        for (int micro = 0; micro < 2; ++micro) {  // the second adds into the gradients
          Graph<float> g(*gpu);
          const Var x = g.leaf(TensorView<float>(xv.as<float>(), Shape{b, t, c}),
                               TensorView<float>(dx.as<float>(), Shape{b, t, c}));
          std::array<Var, 3> wv{}, bv{};
          for (int i = 0; i < 3; ++i) wv[i] = g.param(params.get(w[i])), bv[i] = g.param(params.get(bias[i]));
          Rng rng(5);
          const Var y = batched ? ops::self_attention(g, x, wv, bv, Var{}, h, alpha, 0.1, true, rng)
                                : ops::attention(g, ops::linear(g, x, wv[0], bv[0]), ops::linear(g, x, wv[1], bv[1]),
                                                 ops::linear(g, x, wv[2], bv[2]), Var{}, h, alpha, 0.1, true, rng);
          if (micro == 0) r.y = g.to_host(y);
          g.backward(ops::sum(g, ops::mul(g, y, g.input(std::span<const float>(upstream), g.shape(y)))));
        }
        r.dx.resize(x_values.size());
        gpu->copy_to_host(r.dx.data(), dx.data(), dx.bytes());
        params.download_grads();
        const TensorView<float> all = params.grads();
        r.grads.assign(all.data(), all.data() + all.numel());
        return r;
      };
      const Run batched = run(true), plain = run(false);
      const double tolerance = gpu->precision() == Precision::kBf16 ? kBf16 : kGemm;
      EXPECT_LE(relative_difference(batched.y, plain.y), tolerance) << "forward";
      EXPECT_LE(relative_difference(batched.dx, plain.dx), tolerance) << "gradient of x";
      auto grad_of = [&](const Run& r, ParamId id) {
        const int64_t at = params.offset(id), n = params.shape(id).numel();
        return std::vector<float>(r.grads.begin() + at, r.grads.begin() + at + n);
      };
      auto largest = [](const std::vector<float>& v) {
        float m = 0;
        for (float e : v) m = std::max(m, std::abs(e));
        return m;
      };
      for (int i = 0; i < 3; ++i) {
        EXPECT_LE(relative_difference(grad_of(batched, w[i]), grad_of(plain, w[i])), tolerance) << params.name(w[i]);
        if (i == 1) continue;
        EXPECT_LE(relative_difference(grad_of(batched, bias[i]), grad_of(plain, bias[i])), tolerance)
            << params.name(bias[i]);
      }
      // The key bias's gradient is zero up to rounding (softmax ignores a constant added to every key's score;
      // in BF16 about 1% of the query bias's): small, and the same either way against the query bias's scale.
      const float bias_scale = largest(grad_of(plain, bias[0]));
      EXPECT_GT(bias_scale, 0.0f);
      EXPECT_LE(largest(grad_of(plain, bias[1])), (gpu->precision() == Precision::kBf16 ? 2e-2f : 1e-4f) * bias_scale);
      std::vector<float> key_difference = grad_of(batched, bias[1]);
      const std::vector<float> key_plain = grad_of(plain, bias[1]);
      for (size_t i = 0; i < key_difference.size(); ++i) key_difference[i] -= key_plain[i];
      EXPECT_LE(largest(key_difference), tolerance * bias_scale);
    }
  }
}

// quantized_projections (QAT's Q, K and V: one GEMM each way, each quantizer reading its part of the
// (N, 3C) product in place) against three linears and fake_quantizes on the same GPU, the weights through
// fake_quantize_many as the model quantizes them (side by side: the batched and stacked products) and in
// another order (not equally spaced: three products and stacked copies). Dyadic inputs (x in eighths,
// weights in 64ths, exactly their quantized values, biases in 128ths, upstream gradients in 16ths) make
// every product's sum exact in either order, so values, weight, bias and scale gradients and saturation
// counts agree bit for bit; x's gradient too in FP32 (in BF16 the three linears round each partial sum of
// it to BF16). Also with V's output unread (its part of the projections' gradient zero), and twice from the
// same weights (two layers' worth: the first one's quantized weights then take their gradients from the
// buffers the second one's released, not equally spaced, so the fresh gradients go through the transient
// product and copies).
TEST_F(CudaOps, QuantizedProjectionsGiveThreeLinearsAndTheirQuantizers) {
  const int64_t b = 2, t = 40, c = 64, n = b * t;
  auto dyadic = [](int64_t count, uint32_t seed, int range, float denominator) {
    std::mt19937 gen(seed);
    std::uniform_int_distribution<int> pick(-range, range);
    std::vector<float> v(static_cast<size_t>(count));
    for (float& e : v) e = float(pick(gen)) / denominator;
    return v;
  };
  for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()})
    for (bool reordered : {false, true})
      for (bool v_read : {true, false})
        for (bool twice : {false, true}) {
          if (twice && (reordered || !v_read)) continue;
          const bool bf16 = gpu->precision() == Precision::kBf16;
          SCOPED_TRACE(gpu->name() + (reordered ? ", weights not equally spaced" : ", weights side by side") +
                       (v_read ? "" : ", V unread") + (twice ? ", twice" : ""));
          struct Run {
            std::vector<float> y, dx, dw, db, dws, ds;
            std::vector<int64_t> clipped;
          };
          auto run = [&](bool fused) {
            std::vector<DeviceBuffer> buffers;
            auto buffer = [&](const std::vector<float>& host) {
              buffers.emplace_back(*gpu, host.size() * 4);
              gpu->copy_to_device(buffers.back().data(), host.data(), host.size() * 4);
              return buffers.back().as<float>();
            };
            auto zeros = [&](int64_t count) { return buffer(std::vector<float>(size_t(count), 0.0f)); };
            float* xv = buffer(dyadic(n * c, 1, 8, 8.0f));
            float* dx = zeros(n * c);
            float* wv = buffer(dyadic(3 * c * c, 2, 16, 64.0f));
            float* dw = zeros(3 * c * c);
            float* ws = buffer(std::vector<float>(size_t(3 * c), 1.0f / 64));  // per channel: w / s within 16
            float* dws = zeros(3 * c);
            float* bv = buffer(dyadic(3 * c, 3, 16, 128.0f));
            float* db = zeros(3 * c);
            float* sv = buffer({1.0f / 64, 1.0f / 32, 1.0f / 64});  // values past 127 / 64 saturate
            float* ds = zeros(3);
            DeviceBuffer counters(*gpu, 8 * 3);
            gpu->fill_zero(counters.data(), counters.bytes());
            Graph<float> g(*gpu);
            const Shape xs{b, t, c}, square{c, c};
            const Var x = g.leaf(TensorView<float>(xv, xs), TensorView<float>(dx, xs));
            std::vector<ops::QuantizeInput> weight_inputs;
            std::array<Var, 3> biases{}, scales{};
            std::array<ops::QuantizeOutput, 3> quantizers{};
            for (int i = 0; i < 3; ++i) {
              const Var w =
                  g.leaf(TensorView<float>(wv + i * c * c, square), TensorView<float>(dw + i * c * c, square));
              const Var s = g.leaf(TensorView<float>(ws + i * c, Shape{c}), TensorView<float>(dws + i * c, Shape{c}));
              weight_inputs.push_back({w, ops::QuantizeOutput{s, -127, 127, 0.05}});
              biases[i] = g.leaf(TensorView<float>(bv + i * c, Shape{c}), TensorView<float>(db + i * c, Shape{c}));
              scales[i] = g.leaf(TensorView<float>(sv + i, Shape{1}), TensorView<float>(ds + i, Shape{1}));
              quantizers[i] = ops::QuantizeOutput{scales[i], -128, 127, 0.1 * (i + 1), counters.as<int64_t>() + i};
            }
            if (reordered) std::swap(weight_inputs[1], weight_inputs[2]);  // made V, K: not equally spaced
            Run r;
            Var loss;
            for (int layer = 0; layer < (twice ? 2 : 1); ++layer) {
              std::vector<Var> quantized =
                  ops::fake_quantize_many(g, std::span<const ops::QuantizeInput>(weight_inputs));
              if (reordered) std::swap(quantized[1], quantized[2]);
              const std::array<Var, 3> w = {quantized[0], quantized[1], quantized[2]};
              std::array<Var, 3> ys{};
              if (fused) {
                ys = ops::quantized_projections(g, x, w, biases, quantizers);
              } else {
                for (int i = 0; i < 3; ++i) {
                  const ops::QuantizeOutput& q = quantizers[i];
                  ys[i] = ops::fake_quantize(g, ops::linear(g, x, w[i], biases[i]), q.scale, q.qmin, q.qmax,
                                             q.grad_scale, q.clipped);
                }
              }
              for (int i = 0; i < 3; ++i) {
                const std::vector<float> y = g.to_host(ys[i]);
                r.y.insert(r.y.end(), y.begin(), y.end());
                if (i == 2 && !v_read) continue;
                const std::vector<float> up = dyadic(n * c, 10 + 3 * layer + i, 16, 16.0f);
                const Var term = ops::sum(g, ops::mul(g, ys[i], g.input(std::span<const float>(up), xs)));
                loss = loss.valid() ? ops::add(g, loss, term) : term;
              }
            }
            g.backward(loss);
            auto host = [&](const float* p, int64_t count) {
              std::vector<float> v(static_cast<size_t>(count));
              gpu->copy_to_host(v.data(), p, count * 4);
              return v;
            };
            r.dx = host(dx, n * c), r.dw = host(dw, 3 * c * c), r.db = host(db, 3 * c), r.dws = host(dws, 3 * c);
            r.ds = host(ds, 3);
            r.clipped.resize(3);
            gpu->copy_to_host(r.clipped.data(), counters.data(), 8 * 3);
            return r;
          };
          const Run fused = run(true), plain = run(false);
          EXPECT_EQ(fused.y, plain.y) << "values";
          EXPECT_LE(relative_difference(fused.dx, plain.dx), bf16 ? kBf16 : kExact) << "gradient of x";
          EXPECT_EQ(fused.dw, plain.dw) << "weights' gradients";
          EXPECT_EQ(fused.db, plain.db) << "biases' gradients";
          EXPECT_EQ(fused.dws, plain.dws) << "weight scales' gradients";
          EXPECT_EQ(fused.ds, plain.ds) << "the three quantizers' scale gradients";
          EXPECT_EQ(fused.clipped, plain.clipped) << "saturation counts";
          EXPECT_GT(plain.clipped[0] + plain.clipped[2], 0) << "the case saturates";
          float largest_ds = 0;
          for (float v : plain.ds) largest_ds = std::max(largest_ds, std::abs(v));
          EXPECT_GT(largest_ds, 0.0f) << "the scales take gradients";
          if (!v_read) {
            EXPECT_EQ(plain.ds[2], 0.0f);
          }
        }
}

TEST_F(CudaOps, CrossEntropyWithIgnoredRowsAndWeights) {
  const std::vector<int32_t> targets = {3, -1, 0, 9, 9, -1, 4};
  compare(
      {Shape{7, 10}},
      [&](Graph<float>& g, const std::vector<Var>& in) { return ops::cross_entropy<float>(g, in[0], targets); },
      kReduction, kReduction, {}, 4.0f);
  const std::vector<float> weights = {0.5f, 1.0f, 2.0f, 1.0f, 0.25f, 3.0f, 1.0f};
  compare(
      {Shape{7, 10}},
      [&](Graph<float>& g, const std::vector<Var>& in) {
        return ops::cross_entropy<float>(g, in[0], targets, weights);
      },
      kReduction, kReduction, {}, 4.0f);
  const std::vector<int32_t> wide = {1, 30000, 12345};  // a vocabulary-sized row
  compare(
      {Shape{3, 30522}},
      [&](Graph<float>& g, const std::vector<Var>& in) { return ops::cross_entropy<float>(g, in[0], wide); },
      kReduction, kReduction);
  const std::vector<int32_t> none = {-1, -1};  // no active row: loss 0, no gradient
  compare(
      {Shape{2, 5}},
      [&](Graph<float>& g, const std::vector<Var>& in) { return ops::cross_entropy<float>(g, in[0], none); }, kExact,
      kExact);
}

// cross_entropy_scores: the loss and its gradient as cross_entropy's, the predictions as row_argmax's, on
// vocabulary-wide rows of odd width (each row starts at another offset from a 16-byte boundary) with ties
// in a row's scalar head and in its packed middle, in FP32 and on BF16 logits; the gradient also into a
// buffer offset from the logits' alignment (the kernel's scalar path).
TEST_F(CudaOps, CrossEntropyScoresAreTheLossAndTheArgmaxInOnePass) {
  const std::vector<int32_t> wide = {1, 30000, 12345, 0, 30521, 7, 77};
  compare(
      {Shape{7, 30522}},
      [&](Graph<float>& g, const std::vector<Var>& in) {
        return ops::cross_entropy_scores<float>(g, in[0], wide).loss;
      },
      kReduction, kReduction, {}, 3.0f);
  // Rows held in the registers of 512 threads (9,001 wide) and wider than 1,024 threads hold (the
  // running form).
  const std::vector<int32_t> three = {0, 9000, 4321};
  compare(
      {Shape{3, 9001}},
      [&](Graph<float>& g, const std::vector<Var>& in) {
        return ops::cross_entropy_scores<float>(g, in[0], three).loss;
      },
      kReduction, kReduction, {}, 3.0f);
  const std::vector<int32_t> huge = {70000, 5};
  compare(
      {Shape{2, 70001}},
      [&](Graph<float>& g, const std::vector<Var>& in) {
        return ops::cross_entropy_scores<float>(g, in[0], huge).loss;
      },
      kReduction, kReduction, {}, 3.0f);
  const std::vector<int32_t> narrow = {3, 0, 9, 9, 4};
  compare(
      {Shape{5, 10}},
      [&](Graph<float>& g, const std::vector<Var>& in) {
        return ops::cross_entropy_scores<float>(g, in[0], narrow).loss;
      },
      kReduction, kReduction, {}, 4.0f);

  const int64_t rows = 7, cols = 30522;
  std::vector<float> v = random_values(rows * cols, 8, 2.0f);
  v[0 * cols + 1] = v[0 * cols + 2] = 40.0f;        // a tie in row 0's head
  v[3 * cols + 5000] = v[3 * cols + 20000] = 40.0f;  // a tie in row 3's middle
  v[5 * cols + cols - 1] = 40.0f;                    // the largest in row 5's tail
  Graph<float> cpu;
  const std::vector<int32_t> expected =
      ops::row_argmax(cpu, cpu.constant(TensorView<float>(v.data(), Shape{rows, cols})));
  EXPECT_EQ(expected[0], 1);
  EXPECT_EQ(expected[3], 5000);
  EXPECT_EQ(expected[5], cols - 1);
  for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
    Graph<float> g(*gpu);
    Var x = g.input(std::span<const float>(v), Shape{rows, cols});
    if (gpu->precision() == Precision::kBf16) x = ops::permute(g, x, {0, 1});  // BF16 logits (the ties are exact)
    const ops::LinearScores scores = ops::cross_entropy_scores<float>(g, x, wide);
    EXPECT_EQ(scores.predictions, expected) << gpu->name();
    Graph<float> plain(*gpu);
    Var y = plain.input(std::span<const float>(v), Shape{rows, cols});
    if (gpu->precision() == Precision::kBf16) y = ops::permute(plain, y, {0, 1});
    EXPECT_FLOAT_EQ(g.item(scores.loss), plain.item(ops::cross_entropy<float>(plain, y, wide))) << gpu->name();
  }

  {  // rows too wide for the registers: the running form finds the first largest too
    std::vector<float> w = random_values(2 * 70001, 9, 2.0f);
    w[1 * 70001 + 3] = w[1 * 70001 + 69000] = 40.0f;
    Graph<float> host;
    const std::vector<int32_t> first =
        ops::row_argmax(host, host.constant(TensorView<float>(w.data(), Shape{2, 70001})));
    EXPECT_EQ(first[1], 3);
    Graph<float> g(*gpu_);
    Var x = g.input(std::span<const float>(w), Shape{2, 70001});
    EXPECT_EQ(ops::cross_entropy_scores<float>(g, x, huge).predictions, first);
  }

  // The gradient into a buffer 4 bytes past the logits' alignment, against the CPU's.
  Graph<float> reference;
  std::vector<float> cpu_grad(v.size(), 0.0f);
  Var xc = reference.leaf(TensorView<float>(v.data(), Shape{rows, cols}),
                          TensorView<float>(cpu_grad.data(), Shape{rows, cols}));
  reference.backward(ops::cross_entropy<float>(reference, xc, wide));
  DeviceBuffer value(*gpu_, v.size() * 4), grad(*gpu_, (v.size() + 1) * 4);
  gpu_->copy_to_device(value.data(), v.data(), v.size() * 4);
  gpu_->fill_zero(grad.data(), grad.bytes());
  Graph<float> g(*gpu_);
  Var xg = g.leaf(TensorView<float>(value.as<float>(), Shape{rows, cols}),
                  TensorView<float>(grad.as<float>() + 1, Shape{rows, cols}));
  g.backward(ops::cross_entropy_scores<float>(g, xg, wide).loss);
  std::vector<float> gpu_grad(v.size());
  gpu_->copy_to_host(gpu_grad.data(), grad.as<float>() + 1, gpu_grad.size() * 4);
  EXPECT_LE(relative_difference(gpu_grad, cpu_grad), kReduction);
}

// linear_cross_entropy_scores on a GPU: the loss, predictions and gradients of linear then
// cross_entropy_scores without the logits as a node. Against the CPU's linear + cross_entropy (FP32 and BF16
// tolerances), and against the two GPU ops themselves: bit for bit where the output width needs no padding,
// within float rounding of the log-sum-exp where the GEMM's output is padded (a vocabulary-wide product: the
// rows then start elsewhere against 16-byte boundaries, so each thread sums its exponentials in another
// order), the predictions equal either way.
TEST_F(CudaOps, LinearCrossEntropyScoresAreLinearThenCrossEntropyWithoutTheLogits) {
  struct Case {
    int64_t rows, in, out;
    bool bias, padded;
  };
  // 40 x 30522 outputs take the padded GEMM (30524 wide in FP32, 30528 in BF16); 6 x 37 do not. Padded, the
  // bias gradient's column sums run in the cross-entropy's backward pass: 301 rows, two a block but the last.
  for (const Case c : {Case{6, 16, 37, true, false}, Case{6, 16, 37, false, false}, Case{40, 32, 30522, true, true},
                       Case{301, 32, 30522, true, true}}) {
    SCOPED_TRACE(std::to_string(c.rows) + "x" + std::to_string(c.in) + "->" + std::to_string(c.out) +
                 (c.bias ? " with bias" : " without bias"));
    std::vector<int32_t> targets(static_cast<size_t>(c.rows));
    for (int64_t r = 0; r < c.rows; ++r) targets[r] = static_cast<int32_t>((r * 7919 + 3) % c.out);
    targets.back() = static_cast<int32_t>(c.out - 1);
    std::vector<Shape> shapes = {Shape{c.rows, c.in}, Shape{c.out, c.in}};
    if (c.bias) shapes.push_back(Shape{c.out});
    const auto bias_of = [&](const std::vector<Var>& in) { return c.bias ? in[2] : Var{}; };
    const Build scored = [&](Graph<float>& g, const std::vector<Var>& in) {
      if (!g.on_cuda()) return ops::cross_entropy<float>(g, ops::linear(g, in[0], in[1], bias_of(in)), targets);
      return ops::linear_cross_entropy_scores(g, in[0], in[1], bias_of(in), targets).loss;
    };
    compare(shapes, scored, kGemm, kGemm, {}, 0.5f);

    const Build composed = [&](Graph<float>& g, const std::vector<Var>& in) {
      return ops::cross_entropy_scores<float>(g, ops::linear(g, in[0], in[1], bias_of(in)), targets).loss;
    };
    std::vector<std::vector<float>> inputs;
    for (size_t i = 0; i < shapes.size(); ++i)
      inputs.push_back(random_values(shapes[i].numel(), 21 + uint32_t(i), 0.5f));
    const std::vector<bool> differentiable(shapes.size(), true);
    for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
      SCOPED_TRACE(gpu->name());
      const Result fused = run_on(*gpu, shapes, inputs, differentiable, scored, 5);
      const Result plain = run_on(*gpu, shapes, inputs, differentiable, composed, 5);
      // Padded, a BF16 gradient of the logits may round the other way where the log-sum-exp moved by an ulp.
      const double loss_tolerance = c.padded ? 1e-6 : kExact;
      const double grad_tolerance = !c.padded ? kExact : gpu->precision() == Precision::kBf16 ? 4e-3 : 1e-5;
      EXPECT_LE(relative_difference(fused.value, plain.value), loss_tolerance) << "loss";
      for (size_t i = 0; i < shapes.size(); ++i)
        EXPECT_LE(relative_difference(fused.grads[i], plain.grads[i]), grad_tolerance) << "gradient " << i;

      std::vector<std::vector<float>> values = inputs;  // the predictions, on the host and left on the device
      Graph<float> g(*gpu);
      std::vector<Var> in;
      for (size_t i = 0; i < shapes.size(); ++i) in.push_back(g.input(std::span<const float>(values[i]), shapes[i]));
      NoGradGuard<float> no_grad(g);
      const std::vector<int32_t> expected =
          ops::cross_entropy_scores<float>(g, ops::linear(g, in[0], in[1], bias_of(in)), targets).predictions;
      EXPECT_EQ(ops::linear_cross_entropy_scores(g, in[0], in[1], bias_of(in), targets).predictions, expected);
      const ops::LinearScores kept =
          ops::linear_cross_entropy_scores(g, in[0], in[1], bias_of(in), targets, ops::PredictionsTo::kDevice);
      ASSERT_NE(kept.device_predictions, nullptr);
      EXPECT_TRUE(kept.predictions.empty());
      std::vector<int32_t> read(expected.size());
      gpu->copy_to_host(read.data(), kept.device_predictions, read.size() * sizeof(int32_t));
      EXPECT_EQ(read, expected);
    }
  }

  // Bad input: a target outside the outputs, a width that does not fit the weight.
  Graph<float> g(*gpu_);
  const std::vector<float> x = random_values(4 * 8, 1), w = random_values(10 * 8, 2);
  const Var xv = g.input(std::span<const float>(x), Shape{4, 8}), wv = g.input(std::span<const float>(w), Shape{10, 8});
  EXPECT_THROW(ops::linear_cross_entropy_scores(g, xv, wv, Var{}, std::vector<int32_t>{0, 1, 10, 2}), std::exception);
  EXPECT_THROW(ops::linear_cross_entropy_scores(g, xv, wv, Var{}, std::vector<int32_t>{0, 1}), std::exception);
  EXPECT_THROW(
      ops::linear_cross_entropy_scores(g, ops::reshape(g, xv, Shape{8, 4}), wv, Var{}, std::vector<int32_t>(8, 0)),
      std::exception);
}

// The feed-forward block on a GPU: the CPU's values within the GEMM tolerance (BF16: kBf16), and against
// linear, gelu, linear on the same GPU, forward and every gradient, with x's gradient added to (x is also
// the residual) and written fresh: in FP32 the same bits; in BF16, where the GELU and its derivative run in
// cuBLASLt's epilogues (the tanh form, of the unrounded sums), within kBf16; a width that would run padded
// takes the three ops (the same bits). In FP32 its forward keeps the first product but not the GELU's
// output: the workspace holds one (rows, hidden) tensor less; in BF16 it keeps no more than the three ops.
TEST_F(CudaOps, FeedForwardIsLinearGeluLinear) {
  struct Case {
    int64_t rows, width, hidden;
  };
  // 37 rows: odd packs; 9,001 rows: b1's column sums (taken in the GELU's backward pass) over chunks of
  // more than 64 rows, the last one short; 1,024 x 1,030 runs padded in either precision (1,030 is no
  // multiple of 4 or 8).
  for (const Case c : {Case{37, 24, 64}, Case{256, 64, 256}, Case{9001, 16, 72}, Case{1024, 32, 1030}}) {
    SCOPED_TRACE(std::to_string(c.rows) + " rows, " + std::to_string(c.width) + " -> " + std::to_string(c.hidden));
    const std::vector<Shape> shapes = {Shape{c.rows, c.width}, Shape{c.hidden, c.width}, Shape{c.hidden},
                                       Shape{c.width, c.hidden}, Shape{c.width}};
    for (const bool residual : {false, true}) {
      SCOPED_TRACE(residual ? "x also the residual" : "x read once");
      const Build fused = [&](Graph<float>& g, const std::vector<Var>& in) {
        const Var y = ops::feed_forward(g, in[0], in[1], in[2], in[3], in[4]);
        return residual ? ops::add(g, y, in[0]) : y;
      };
      const Build composed = [&](Graph<float>& g, const std::vector<Var>& in) {
        const Var y = ops::linear(g, ops::gelu(g, ops::linear(g, in[0], in[1], in[2])), in[3], in[4]);
        return residual ? ops::add(g, y, in[0]) : y;
      };
      compare(shapes, fused, kGemm, kGemm, {}, 0.5f);
      std::vector<std::vector<float>> inputs;
      for (size_t i = 0; i < shapes.size(); ++i)
        inputs.push_back(random_values(shapes[i].numel(), 31 + uint32_t(i), 0.5f));
      const std::vector<bool> differentiable(shapes.size(), true);
      for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
        SCOPED_TRACE(gpu->name());
        const Result f = run_on(*gpu, shapes, inputs, differentiable, fused, 7);
        const Result p = run_on(*gpu, shapes, inputs, differentiable, composed, 7);
        const double tolerance = gpu->precision() == Precision::kBf16 && c.hidden != 1030 ? kBf16 : kExact;
        EXPECT_LE(relative_difference(f.value, p.value), tolerance) << "forward";
        for (size_t i = 0; i < shapes.size(); ++i)
          EXPECT_LE(relative_difference(f.grads[i], p.grads[i]), tolerance) << "gradient of input " << i;
      }
    }
    for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {  // what the forward keeps for the backward
      SCOPED_TRACE(gpu->name());
      auto kept = [&](bool fused) {
        Graph<float> g(*gpu);
        std::vector<DeviceBuffer> storage;
        std::vector<Var> in;
        for (const Shape& s : shapes) {
          storage.emplace_back(*gpu, s.numel() * sizeof(float) * 2);
          const auto v = TensorView<float>(storage.back().as<float>(), s);
          gpu->fill_zero(v.data(), s.numel() * sizeof(float) * 2);
          in.push_back(g.leaf(v, TensorView<float>(storage.back().as<float>() + s.numel(), s)));
        }
        const size_t before = g.workspace().bytes_in_use();
        fused ? ops::feed_forward(g, in[0], in[1], in[2], in[3], in[4])
              : ops::linear(g, ops::gelu(g, ops::linear(g, in[0], in[1], in[2])), in[3], in[4]);
        return g.workspace().bytes_in_use() - before;
      };
      const size_t element = gpu->precision() == Precision::kBf16 ? 2 : 4;
      const size_t gelu_output = static_cast<size_t>(c.rows * c.hidden) * element;
      if (c.hidden == 1030)
        EXPECT_EQ(kept(true), kept(false));  // padded: the three ops
      else if (gpu->precision() == Precision::kBf16)
        EXPECT_LE(kept(true), kept(false));
      else
        EXPECT_LE(kept(true) + gelu_output, kept(false));
    }
  }
  Graph<float> g(*gpu_);  // bad input: widths that do not chain, a missing bias
  const std::vector<float> x = random_values(4 * 8, 1), w1 = random_values(16 * 8, 2), w2 = random_values(8 * 12, 3),
                           b = random_values(16, 4);
  const Var xv = g.input(std::span<const float>(x), Shape{4, 8}),
            w1v = g.input(std::span<const float>(w1), Shape{16, 8}),
            w2v = g.input(std::span<const float>(w2), Shape{8, 12}),
            b1v = g.input(std::span<const float>(b), Shape{16}),
            b2v = g.input(std::span<const float>(b.data(), 8), Shape{8});
  EXPECT_THROW(ops::feed_forward(g, xv, w1v, b1v, w2v, b2v), std::exception);
  EXPECT_THROW(ops::feed_forward(g, xv, w1v, Var{}, ops::reshape(g, w2v, Shape{6, 16}), b2v), std::exception);
}

// An operand broadcast along leading axes only (position embeddings over the batch) sums its gradient
// by columns; widths that move in packs of four and widths that do not, a 3-D operand, and a gradient
// added into (the operand read twice).
TEST_F(CudaOps, LeadingBroadcastGradientsSumOverTheBatch) {
  const auto add = [](Graph<float>& g, const std::vector<Var>& in) { return ops::add(g, in[0], in[1]); };
  compare({Shape{5, 16, 128}, Shape{16, 128}}, add, kExact, kReduction);
  compare({Shape{5, 16, 131}, Shape{16, 131}}, add, kExact, kReduction);
  compare({Shape{3, 32, 64}, Shape{1, 32, 64}}, add, kExact, kReduction);
  compare({Shape{2, 3, 32, 64}, Shape{32, 64}}, add, kExact, kReduction);
  compare(
      {Shape{4, 40, 64}, Shape{40, 64}},
      [](Graph<float>& g, const std::vector<Var>& in) {
        return ops::add(g, ops::add(g, in[0], in[1]), ops::scale(g, in[1], 0.5));
      },
      kElementwise, kReduction);
}

TEST_F(CudaOps, DistillationLossOnVocabularySizedRows) {
  for (double temperature : {1.0, 2.0})
    compare(
        {Shape{5, 30522}, Shape{5, 30522}},
        [temperature](Graph<float>& g, const std::vector<Var>& in) {
          return ops::distillation_loss(g, in[0], in[1], temperature);
        },
        kReduction, kReduction, {true, false}, 3.0f);
  compare({Shape{3, 2}, Shape{3, 2}},
          [](Graph<float>& g, const std::vector<Var>& in) { return ops::distillation_loss(g, in[0], in[1], 1.5); },
          kReduction, kReduction, {true, false});
}

// A regression's loss on the GPU (composed of add, scale, mul and mean there too): the CPU's value and
// gradient, predictions (B, 1) against targets (B), a BF16 prediction met in F32.
TEST_F(CudaOps, MeanSquaredErrorOfScores) {
  compare({Shape{37, 1}, Shape{37}},
          [](Graph<float>& g, const std::vector<Var>& in) { return ops::mean_squared_error(g, in[0], in[1]); },
          kReduction, kReduction, {true, false});
}

TEST_F(CudaOps, SumAndMean) {
  compare(
      {Shape{1000, 37}}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::sum(g, in[0]); }, kReduction,
      kExact);
  compare(
      {Shape{3, 5}}, [](Graph<float>& g, const std::vector<Var>& in) { return ops::mean(g, in[0]); }, kReduction,
      kExact);
}

TEST_F(CudaOps, FakeQuantizeRoundsLikeTheCpuBitForBit) {
  // Per tensor and per channel; values spread so that some saturate; scales positive.
  for (int64_t channels : {int64_t{1}, int64_t{6}}) {
    SCOPED_TRACE(channels);
    std::vector<float> scale_values(static_cast<size_t>(channels));
    for (int64_t c = 0; c < channels; ++c) scale_values[c] = 0.01f * float(c + 1);
    compare(
        {Shape{6, 4001}},
        [&](Graph<float>& g, const std::vector<Var>& in) {
          Var s = g.input(std::span<const float>(scale_values), Shape{channels});
          return ops::fake_quantize(g, in[0], s, -128, 127, 0.5);
        },
        kExact, kExact, {}, 2.0f);
  }
}

// The GPU divides by a scale through its reciprocal and one FMA correction (cuda::ScaleDivision): at every
// rounding boundary of 260 steps (each halfway point, one ulp either side of it, each step) and for 64
// scales from 2^-20 to 4 (powers of two, all-ones mantissas, random ones) it gives what dividing, rounding
// half to even and clamping give on the host, bit for bit, as the CPU op does, and counts the same
// saturations.
TEST_F(CudaOps, FakeQuantizeDividesAsTheCpuAtEveryRoundingBoundary) {
  const int64_t channels = 64, per_channel = 260 * 4;
  std::mt19937 gen(5);
  std::vector<float> scales(channels), x, expected;
  for (int64_t c = 0; c < channels; ++c) {
    const uint32_t exponent = 127 - 20 + gen() % 23;
    const uint32_t mantissa = c % 4 == 0 ? 0x7FFFFFu : c % 4 == 1 ? 0u : gen() & 0x7FFFFFu;
    const uint32_t bits = exponent << 23 | mantissa;
    std::memcpy(&scales[c], &bits, 4);
    for (int k = -130; k < 130; ++k) {
      const float half = (float(k) + 0.5f) * scales[c];
      for (float v : {std::nextafter(half, -INFINITY), half, std::nextafter(half, INFINITY), float(k) * scales[c]}) {
        x.push_back(v);
        expected.push_back(std::clamp(std::nearbyint(v / scales[c]), -128.0f, 127.0f) * scales[c]);
      }
    }
  }
  auto run = [&](const Device& device, int64_t* clipped) {
    Graph<float> g(device);
    DeviceBuffer counter(device, 8);
    device.fill_zero(counter.data(), 8);
    Var s = g.input(std::span<const float>(scales), Shape{channels});
    Var in = g.input(std::span<const float>(x), Shape{channels, per_channel});
    std::vector<float> y = g.to_host(ops::fake_quantize(g, in, s, -128, 127, 1.0, counter.as<int64_t>()));
    device.copy_to_host(clipped, counter.data(), 8);
    return y;
  };
  auto differing = [&](const std::vector<float>& y) {
    EXPECT_EQ(y.size(), expected.size());
    int64_t n = 0;
    for (size_t i = 0; i < y.size() && i < expected.size(); ++i) n += std::memcmp(&y[i], &expected[i], 4) != 0;
    return n;
  };
  int64_t cpu_clipped = 0, gpu_clipped = 0;
  EXPECT_EQ(differing(run(Device::cpu(), &cpu_clipped)), 0);
  EXPECT_EQ(differing(run(*gpu_, &gpu_clipped)), 0);
  EXPECT_GT(cpu_clipped, 0);
  EXPECT_EQ(gpu_clipped, cpu_clipped);
}

TEST_F(CudaOps, FakeQuantizeScaleGradientAndSaturationCount) {
  const std::vector<float> x = random_values(5 * 40000, 3, 1.5f);
  const std::vector<float> five = {0.004f, 0.01f, 0.02f, 0.005f, 0.03f};
  // Per tensor, five channels of 40,000 (several blocks each) and 200 of 1,000 (a warp each, as a weight's rows).
  auto run = [&](const Device& device, int64_t channels, std::vector<float>* grad_scale, int64_t* clipped) {
    std::vector<float> scales(channels);
    for (int64_t c = 0; c < channels; ++c) scales[c] = five[c % 5];
    const Shape shape{channels, 5 * 40000 / channels};
    Graph<float> g(device);
    DeviceBuffer xv(device, x.size() * 4), sv(device, channels * 4), sg(device, channels * 4), counter(device, 8);
    device.copy_to_device(xv.data(), x.data(), x.size() * 4);
    device.copy_to_device(sv.data(), scales.data(), channels * 4);
    device.fill_zero(sg.data(), channels * 4);
    device.fill_zero(counter.data(), 8);
    Var xin = g.constant(TensorView<float>(xv.as<float>(), shape));
    Var s =
        g.leaf(TensorView<float>(sv.as<float>(), Shape{channels}), TensorView<float>(sg.as<float>(), Shape{channels}));
    Var y = ops::fake_quantize(g, xin, s, -128, 127, 0.25, counter.as<int64_t>());
    const std::vector<float> up = random_values(5 * 40000, 8);
    g.backward(ops::sum(g, ops::mul(g, y, g.input(std::span<const float>(up), shape))));
    grad_scale->resize(channels);
    device.copy_to_host(grad_scale->data(), sg.data(), channels * 4);
    device.copy_to_host(clipped, counter.data(), 8);
  };
  for (int64_t channels : {int64_t{1}, int64_t{5}, int64_t{200}}) {
    SCOPED_TRACE(channels);
    std::vector<float> cpu_grad, gpu_grad, bf16_grad;
    int64_t cpu_clipped = 0, gpu_clipped = 0, bf16_clipped = 0;
    run(Device::cpu(), channels, &cpu_grad, &cpu_clipped);
    run(*gpu_, channels, &gpu_grad, &gpu_clipped);
    run(*gpu_bf16_, channels, &bf16_grad, &bf16_clipped);  // x stays F32: the same elements saturate
    EXPECT_GT(cpu_clipped, 0);
    EXPECT_EQ(gpu_clipped, cpu_clipped);
    EXPECT_EQ(bf16_clipped, cpu_clipped);
    EXPECT_LE(relative_difference(gpu_grad, cpu_grad), kReduction);
    EXPECT_LE(relative_difference(bf16_grad, cpu_grad), kBf16);
  }
}

// v rounded to the nearest BF16 value (ties to even), as a float.
float bf16_representable(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&v, &bits, 4);
  return v;
}

// GELU, dropout and softmax (with dropout) with their output's quantizer fused in, against the op followed
// by fake_quantize: on the GPU in FP32 the same values, gradients, scale gradient and saturation
// count (the same arithmetic); in BF16 against the CPU within kBf16 (the fused op quantizes its FP32
// result, not a BF16 copy of it; softmax its probabilities in BF16, as its unfused ops do). Odd sizes run
// in single elements (softmax: the ops in sequence), the rest in packs.
TEST_F(CudaOps, FusedQuantizationEqualsTheOpThenFakeQuantize) {
  struct Case {
    const char* name;
    Shape shape;
    std::function<Var(Graph<float>&, Var, const ops::QuantizeOutput*)> op;
    float scale = 0.025f;  // |gelu(x)| and |x| / 0.9 reach past 127 steps: some saturate
  };
  auto dropout = [](double p, bool training) {
    return [p, training](Graph<float>& g, Var x, const ops::QuantizeOutput* q) {
      Rng rng(77);
      rng.reserve(5);
      return q ? ops::dropout(g, x, p, training, rng, *q) : ops::dropout(g, x, p, training, rng);
    };
  };
  // The attention probabilities: softmax of 4 x (peaked enough that some saturate), a padding mask on every
  // seventh key where asked, dropout in training.
  auto softmax = [](double p, bool training, bool masked) {
    return [=](Graph<float>& g, Var x, const ops::QuantizeOutput* q) {
      Rng rng(78);
      rng.reserve(3);
      const Shape xs = g.shape(x);
      std::vector<float> m(static_cast<size_t>(xs[0] * xs.last()), 0.0f);
      for (size_t i = 3; i < m.size(); i += 7) m[i] = -10000.0f;
      const Var mask = masked ? g.input(std::span<const float>(m), Shape{xs[0], xs.last()}) : Var{};
      const Var scores = ops::scale(g, x, 4.0);
      return q ? ops::softmax_dropout(g, scores, mask, p, training, rng, *q)
               : ops::softmax_dropout(g, scores, mask, p, training, rng);
    };
  };
  const float probabilities = 0.0025f;  // 127 steps: 0.3175, which the largest probabilities pass
  const std::vector<Case> cases = {
      {"gelu", Shape{6, 2048},
       [](Graph<float>& g, Var x, const ops::QuantizeOutput* q) { return q ? ops::gelu(g, x, *q) : ops::gelu(g, x); }},
      {"gelu odd", Shape{5, 333},
       [](Graph<float>& g, Var x, const ops::QuantizeOutput* q) { return q ? ops::gelu(g, x, *q) : ops::gelu(g, x); }},
      {"dropout", Shape{7, 1000}, dropout(0.1, true)},
      {"dropout odd", Shape{7, 1001}, dropout(0.5, true)},
      {"dropout in evaluation", Shape{4, 100}, dropout(0.1, false)},
      {"softmax dropout", Shape{2, 3, 40, 40}, softmax(0.1, true, true), probabilities},
      {"softmax dropout, long rows", Shape{2, 2, 8, 200}, softmax(0.1, true, false), probabilities},
      {"softmax in evaluation", Shape{3, 2, 16, 24}, softmax(0.1, false, true), probabilities},
      {"softmax dropout odd (the ops in sequence)", Shape{2, 2, 5, 37}, softmax(0.1, true, true), probabilities},
  };
  struct Run {
    std::vector<float> y, dx, dscale;
    int64_t clipped = 0;
  };
  auto run = [](const Device& device, const Case& c, bool fused) {
    const int64_t n = c.shape.numel();
    // Inputs that BF16 holds exactly: in BF16 the op then sees the CPU's inputs, and only its output and
    // the gradients are rounded (a rounded input would move values across the clipping boundary).
    std::vector<float> x = random_values(n, 5, 2.0f);
    for (float& v : x) v = bf16_representable(v);
    const std::vector<float> up = random_values(n, 6);
    const float scale_value = c.scale;
    Graph<float> g(device);
    DeviceBuffer xv(device, n * 4), xg(device, n * 4), sv(device, 4), sg(device, 4), counter(device, 8);
    device.copy_to_device(xv.data(), x.data(), n * 4);
    device.copy_to_device(sv.data(), &scale_value, 4);
    device.fill_zero(xg.data(), n * 4);
    device.fill_zero(sg.data(), 4);
    device.fill_zero(counter.data(), 8);
    Var xin = g.leaf(TensorView<float>(xv.as<float>(), c.shape), TensorView<float>(xg.as<float>(), c.shape));
    Var s = g.leaf(TensorView<float>(sv.as<float>(), Shape{1}), TensorView<float>(sg.as<float>(), Shape{1}));
    const ops::QuantizeOutput q{s, -128, 127, 0.3, counter.as<int64_t>()};
    Var y = fused ? c.op(g, xin, &q) : ops::fake_quantize(g, c.op(g, xin, nullptr), s, -128, 127, 0.3, q.clipped);
    Run r;
    r.y = g.to_host(y);
    g.backward(ops::sum(g, ops::mul(g, y, g.input(std::span<const float>(up), g.shape(y)))));
    r.dx.resize(n);
    r.dscale.resize(1);
    device.copy_to_host(r.dx.data(), xg.data(), n * 4);
    device.copy_to_host(r.dscale.data(), sg.data(), 4);
    device.copy_to_host(&r.clipped, counter.data(), 8);
    return r;
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Run cpu = run(Device::cpu(), c, false);
    const Run separate = run(*gpu_, c, false), fused = run(*gpu_, c, true), bf16 = run(*gpu_bf16_, c, true);
    EXPECT_GT(cpu.clipped, 0);
    EXPECT_LE(relative_difference(fused.y, separate.y), kExact);
    EXPECT_LE(relative_difference(fused.dx, separate.dx), kExact);
    EXPECT_LE(relative_difference(fused.dscale, separate.dscale), kReduction);
    EXPECT_EQ(fused.clipped, separate.clipped);
    EXPECT_LE(relative_difference(bf16.y, cpu.y), kBf16);
    EXPECT_LE(relative_difference(bf16.dx, cpu.dx), kBf16);
    EXPECT_LE(relative_difference(bf16.dscale, cpu.dscale), kBf16);
    EXPECT_NEAR(double(bf16.clipped), double(cpu.clipped), 0.01 * double(cpu.clipped));
  }
}

// The quantized GELU reading a linear's output alone (the QAT feed-forward block's first product) sums that
// linear's bias gradient in its own backward pass (cuda::column_sums over GeluQuantizedBackwardRows), and
// says so (Graph::bias_summed); with a second reader of the linear's output (adding nothing: 0 times it)
// the linear sums it itself. Both the same bits for the output and the gradients of the input, weight and
// bias (the same arithmetic, the bias's sums in the same order), the scale gradient within kReduction
// (block shares in another order), in FP32 and BF16 (the path apart is held against the CPU by
// FusedQuantizationEqualsTheOpThenFakeQuantize and LinearWithAndWithoutBias). Widths of 4, 2 and 1 columns
// a thread, a partial row chunk, some outputs saturating.
TEST_F(CudaOps, QuantizedGeluSumsTheBiasGradientOfTheLinearItReads) {
  struct Run {
    std::vector<float> y, dx, dw, db, dscale;
    bool summed_by_gelu = false;
  };
  for (const auto& [rows, in, out] : {std::array<int64_t, 3>{150, 40, 128}, std::array<int64_t, 3>{600, 24, 256},
                                      std::array<int64_t, 3>{150, 40, 30}, std::array<int64_t, 3>{77, 16, 45}}) {
    SCOPED_TRACE(std::to_string(rows) + " rows, " + std::to_string(out) + " wide");
    const std::vector<float> x = random_values(rows * in, 31, 1.5f), w = random_values(out * in, 32, 0.5f),
                             b = random_values(out, 33), up = random_values(rows * out, 34);
    auto run = [&](const Device& device, bool second_reader) {
      Graph<float> g(device);
      const float scale_value = 0.025f;  // |gelu| past 127 steps (3.175): some saturate
      std::vector<DeviceBuffer> buffers;
      auto leaf = [&](const std::vector<float>& v, Shape shape) {
        const int64_t bytes = int64_t(v.size()) * 4;
        buffers.emplace_back(device, bytes);
        device.copy_to_device(buffers.back().data(), v.data(), bytes);
        buffers.emplace_back(device, bytes);
        device.fill_zero(buffers.back().data(), bytes);
        return g.leaf(TensorView<float>(buffers[buffers.size() - 2].as<float>(), shape),
                      TensorView<float>(buffers.back().as<float>(), shape));
      };
      const Var xv = leaf(x, Shape{rows, in}), wv = leaf(w, Shape{out, in}), bv = leaf(b, Shape{out}),
                sv = leaf({scale_value}, Shape{1});
      const ops::QuantizeOutput q{sv, -128, 127, 0.3, nullptr};
      const Var a = ops::linear(g, xv, wv, bv);
      Var y = ops::gelu(g, a, q);
      if (second_reader) y = ops::add(g, y, ops::scale(g, a, 0.0));
      Run r;
      r.y = g.to_host(y);
      // Read while the graph stands (backward clears it): on_final comes once a leaf's gradient is complete.
      g.backward(ops::sum(g, ops::mul(g, y, g.input(std::span<const float>(up), g.shape(y)))),
                 [&](TensorView<float>) { r.summed_by_gelu = r.summed_by_gelu || g.bias_summed(a); });
      auto grad = [&](size_t i, size_t n) {
        std::vector<float> v(n);
        device.copy_to_host(v.data(), buffers[2 * i + 1].data(), int64_t(n) * 4);
        return v;
      };
      r.dx = grad(0, x.size()), r.dw = grad(1, w.size()), r.db = grad(2, b.size()), r.dscale = grad(3, 1);
      return r;
    };
    for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
      const bool bf16 = gpu->precision() == Precision::kBf16;
      SCOPED_TRACE(bf16 ? "bf16" : "fp32");
      const Run summed = run(*gpu, false), apart = run(*gpu, true);
      EXPECT_TRUE(summed.summed_by_gelu);
      EXPECT_FALSE(apart.summed_by_gelu);
      EXPECT_LE(relative_difference(summed.y, apart.y), kExact);
      EXPECT_LE(relative_difference(summed.dx, apart.dx), kExact);
      EXPECT_LE(relative_difference(summed.dw, apart.dw), kExact);
      EXPECT_LE(relative_difference(summed.db, apart.db), kExact);
      EXPECT_LE(relative_difference(summed.dscale, apart.dscale), kReduction);
      EXPECT_GT(std::abs(summed.dscale[0]), 0.0f);
    }
  }
}

// Fused attention with the probabilities' quantizer (QAT) against the ops in sequence on the CPU (scores,
// softmax, dropout, fake_quantize, context): in BF16 and TF32 the fused kernels (the probabilities normalised
// by a first pass, quantized inside), in FP32 the GPU's ops in sequence. Inputs BF16 holds exactly and a scale
// of 2^-8 (its multiples too), so BF16 rounds only the output and the gradients; some probabilities past 127
// steps (0.496) saturate. Values, the gradients of Q, K, V and the scale (LSQ), and the saturation count;
// lengths from 7 (one partial key tile) to 512 (eight tiles), masked and not, dropout in training and
// evaluation.
TEST_F(CudaOps, FusedAttentionWithTheProbabilitiesQuantizerGivesTheOps) {
  const std::unique_ptr<Device> tf32 = Device::cuda(0, Precision::kTf32);
  struct Case {
    int64_t b, h, t, d;
  };
  struct Run {
    std::vector<float> y, dscale;
    std::array<std::vector<float>, 3> dqkv;
    int64_t clipped = 0;
  };
  auto run = [](const Device& device, const Case& c, bool masked, double p, bool training,
                float scale_value = 1.0f / 256) {
    const Shape s{c.b, c.t, c.h * c.d};
    const int64_t n = s.numel();
    Graph<float> g(device);
    std::vector<DeviceBuffer> buffers;
    auto leaf = [&](const std::vector<float>& values, const Shape& shape) {
      buffers.emplace_back(device, values.size() * 4);
      device.copy_to_device(buffers.back().data(), values.data(), values.size() * 4);
      buffers.emplace_back(device, values.size() * 4);
      device.fill_zero(buffers.back().data(), values.size() * 4);
      return g.leaf(TensorView<float>(buffers[buffers.size() - 2].as<float>(), shape),
                    TensorView<float>(buffers.back().as<float>(), shape));
    };
    std::array<Var, 3> qkv;
    for (uint32_t i = 0; i < 3; ++i) {
      std::vector<float> x = random_values(n, 41 + i, 1.5f);
      for (float& v : x) v = bf16_representable(v);
      qkv[i] = leaf(x, s);
    }
    const Var scale = leaf({scale_value}, Shape{1});
    DeviceBuffer counter(device, 8);
    device.fill_zero(counter.data(), 8);
    std::vector<float> mask(static_cast<size_t>(c.b * c.t), 0.0f);
    if (masked)  // the last item padded from 60% of its length
      for (int64_t i = c.t * 6 / 10; i < c.t; ++i) mask[(c.b - 1) * c.t + i] = -10000.0f;
    const Var m = masked ? g.input(std::span<const float>(mask), Shape{c.b, c.t}) : Var{};
    Rng rng(77);
    rng.reserve(5);
    const Var y = ops::attention(g, qkv[0], qkv[1], qkv[2], m, c.h, 1.0 / std::sqrt(double(c.d)), p, training, rng,
                                 ops::QuantizeOutput{scale, -128, 127, 0.3, counter.as<int64_t>()});
    Run r;
    r.y = g.to_host(y);
    g.backward(ops::sum(g, ops::mul(g, y, g.input(std::span<const float>(random_values(n, 45)), s))));
    for (size_t i = 0; i < 3; ++i) {
      r.dqkv[i].resize(size_t(n));
      device.copy_to_host(r.dqkv[i].data(), buffers[2 * i + 1].data(), n * 4);
    }
    r.dscale.resize(1);
    device.copy_to_host(r.dscale.data(), buffers[7].data(), 4);
    device.copy_to_host(&r.clipped, counter.data(), 8);
    return r;
  };
  for (const Case c : {Case{2, 3, 7, 16}, Case{2, 2, 64, 32}, Case{3, 2, 100, 64}, Case{2, 2, 128, 64},
                       Case{1, 2, 200, 128}, Case{1, 1, 512, 64}})
    for (bool masked : {false, true})
      for (const auto& [p, training] : {std::pair{0.0, true}, std::pair{0.1, true}, std::pair{0.1, false}}) {
        SCOPED_TRACE("B " + std::to_string(c.b) + " H " + std::to_string(c.h) + " T " + std::to_string(c.t) + " D " +
                     std::to_string(c.d) + (masked ? ", masked" : "") + ", dropout " + std::to_string(p) +
                     (training ? "" : ", evaluation"));
        Graph<float> probe(*gpu_bf16_), probe_tf32(*tf32), probe_fp32(*gpu_);
        ASSERT_TRUE(ops::fused_quantized_attention(probe, c.d, c.t)) << "the BF16 kernels cover this shape";
        ASSERT_TRUE(ops::fused_quantized_attention(probe_tf32, c.d, c.t)) << "the TF32 kernels cover this shape";
        EXPECT_FALSE(ops::fused_quantized_attention(probe_fp32, c.d, c.t)) << "FP32: the ops in sequence";
        const Run cpu = run(Device::cpu(), c, masked, p, training);
        EXPECT_GT(cpu.clipped, 0);
        for (const Device* gpu : {gpu_.get(), gpu_bf16_.get(), tf32.get()}) {
          const Precision precision = gpu->precision();
          const double tol = precision == Precision::kBf16   ? kBf16
                             : precision == Precision::kTf32 ? kTf32AttentionQuantized
                                                             : kAttentionQuantized;
          SCOPED_TRACE(precision == Precision::kFp32 ? "fp32, the ops in sequence" : precision_name(precision) + ", fused");
          const Run r = run(*gpu, c, masked, p, training);
          EXPECT_LE(relative_difference(r.y, cpu.y), tol);
          for (size_t i = 0; i < 3; ++i) EXPECT_LE(relative_difference(r.dqkv[i], cpu.dqkv[i]), tol) << "input " << i;
          EXPECT_LE(relative_difference(r.dscale, cpu.dscale), tol) << "scale";
          EXPECT_NEAR(double(r.clipped), double(cpu.clipped), 0.01 * double(cpu.clipped) + 1);
        }
      }
  // A scale whose reciprocal is no normal float (2^-129: 1 / s overflows) takes the kernels' IEEE division
  // (cuda::with_division's other branch; through the reciprocal, a probability of 0, dropped or masked,
  // would give 0 times infinity, NaN): every other probability saturates, as on the CPU.
  for (const Case c : {Case{2, 2, 128, 64}, Case{1, 2, 200, 64}}) {
    SCOPED_TRACE("T " + std::to_string(c.t) + ", scale 2^-129");
    const float tiny = std::ldexp(1.0f, -129);
    const Run cpu = run(Device::cpu(), c, true, 0.1, true, tiny);
    EXPECT_GT(cpu.clipped, 0);
    for (const Device* gpu : {gpu_bf16_.get(), tf32.get()}) {
      SCOPED_TRACE(precision_name(gpu->precision()));
      const Run r = run(*gpu, c, true, 0.1, true, tiny);
      auto finite = [](const std::vector<float>& v) {
        return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
      };
      EXPECT_TRUE(finite(r.y));
      EXPECT_LE(relative_difference(r.y, cpu.y), kBf16);
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_TRUE(finite(r.dqkv[i])) << "input " << i;
        EXPECT_LE(relative_difference(r.dqkv[i], cpu.dqkv[i]), kBf16) << "input " << i;
      }
      EXPECT_NEAR(double(r.clipped), double(cpu.clipped), 0.01 * double(cpu.clipped) + 1);
    }
  }
}

// dropout_add_layer_norm with the residual add's input quantizer (LayerNorm(q(dropout(a)) + b)) against
// dropout, fake_quantize and add_layer_norm in sequence: on the GPU in FP32 the same values and gradients
// bit for bit (the same arithmetic), the scale gradient within kReduction (other blocks), the same
// saturation count; in BF16 against the CPU within kBf16. Rows of 64 (several a block) and 768 (many
// blocks: the scale gradient's partials), and of 45, which take the ops in sequence on the GPU too;
// dropout in training, the quantizer alone (p = 0) and evaluation.
TEST_F(CudaOps, DropoutAddLayerNormWithItsQuantizerEqualsTheOpsInSequence) {
  struct Run {
    std::vector<float> y, da, db, dgamma, dscale;
    int64_t clipped = 0;
  };
  auto run = [](const Device& device, const Shape& shape, double p, bool training, bool fused) {
    const int64_t n = shape.numel(), c = shape.last();
    std::vector<float> a = random_values(n, 31, 1.0f), b = random_values(n, 32, 1.0f);
    for (float& v : a) v = bf16_representable(v);
    for (float& v : b) v = bf16_representable(v);
    std::vector<float> gamma = random_values(c, 33, 0.5f), beta = random_values(c, 34, 0.5f);
    for (float& v : gamma) v += 1.0f;
    const std::vector<float> up = random_values(n, 35);
    const float scale_value = 0.01f;  // |a| / 0.9 reaches past 127 steps: some saturate
    Graph<float> g(device);
    DeviceBuffer av(device, n * 4), ag(device, n * 4), bv(device, n * 4), bg(device, n * 4), gv(device, c * 4),
        gg(device, c * 4), tv(device, c * 4), sv(device, 4), sg(device, 4), counter(device, 8);
    device.copy_to_device(av.data(), a.data(), n * 4);
    device.copy_to_device(bv.data(), b.data(), n * 4);
    device.copy_to_device(gv.data(), gamma.data(), c * 4);
    device.copy_to_device(tv.data(), beta.data(), c * 4);
    device.copy_to_device(sv.data(), &scale_value, 4);
    device.fill_zero(ag.data(), n * 4);
    device.fill_zero(bg.data(), n * 4);
    device.fill_zero(gg.data(), c * 4);
    device.fill_zero(sg.data(), 4);
    device.fill_zero(counter.data(), 8);
    Var ain = g.leaf(TensorView<float>(av.as<float>(), shape), TensorView<float>(ag.as<float>(), shape));
    Var bin = g.leaf(TensorView<float>(bv.as<float>(), shape), TensorView<float>(bg.as<float>(), shape));
    Var gamma_in = g.leaf(TensorView<float>(gv.as<float>(), Shape{c}), TensorView<float>(gg.as<float>(), Shape{c}));
    Var beta_in = g.constant(TensorView<float>(tv.as<float>(), Shape{c}));
    Var s = g.leaf(TensorView<float>(sv.as<float>(), Shape{1}), TensorView<float>(sg.as<float>(), Shape{1}));
    const ops::QuantizeOutput q{s, -128, 127, 0.3, counter.as<int64_t>()};
    Rng rng(91);
    rng.reserve(7);
    Var y = fused ? ops::dropout_add_layer_norm(g, ain, bin, gamma_in, beta_in, 1e-12, p, training, rng, q)
                  : ops::add_layer_norm(
                        g, ops::fake_quantize(g, ops::dropout(g, ain, p, training, rng), s, -128, 127, 0.3, q.clipped),
                        bin, gamma_in, beta_in, 1e-12);
    Run r;
    r.y = g.to_host(y);
    g.backward(ops::sum(g, ops::mul(g, y, g.input(std::span<const float>(up), shape))));
    r.da.resize(n), r.db.resize(n), r.dgamma.resize(c), r.dscale.resize(1);
    device.copy_to_host(r.da.data(), ag.data(), n * 4);
    device.copy_to_host(r.db.data(), bg.data(), n * 4);
    device.copy_to_host(r.dgamma.data(), gg.data(), c * 4);
    device.copy_to_host(r.dscale.data(), sg.data(), 4);
    device.copy_to_host(&r.clipped, counter.data(), 8);
    return r;
  };
  struct Case {
    Shape shape;
    double p;
    bool training;
  };
  for (const Case& c : {Case{{3, 7, 64}, 0.1, true}, Case{{600, 768}, 0.1, true}, Case{{3, 7, 45}, 0.1, true},
                        Case{{64, 256}, 0.0, true}, Case{{64, 256}, 0.1, false}}) {
    SCOPED_TRACE(c.shape.str() + " p " + std::to_string(c.p) + (c.training ? "" : " evaluation"));
    const Run cpu = run(Device::cpu(), c.shape, c.p, c.training, false);
    const Run separate = run(*gpu_, c.shape, c.p, c.training, false);
    const Run fused = run(*gpu_, c.shape, c.p, c.training, true),
              bf16 = run(*gpu_bf16_, c.shape, c.p, c.training, true);
    EXPECT_GT(cpu.clipped, 0);
    EXPECT_LE(relative_difference(fused.y, separate.y), kExact);
    EXPECT_LE(relative_difference(fused.da, separate.da), kExact);
    EXPECT_LE(relative_difference(fused.db, separate.db), kExact);
    EXPECT_LE(relative_difference(fused.dgamma, separate.dgamma), kExact);
    EXPECT_LE(relative_difference(fused.dscale, separate.dscale), kReduction);
    EXPECT_EQ(fused.clipped, separate.clipped);
    EXPECT_LE(relative_difference(fused.y, cpu.y), kReduction);
    EXPECT_LE(relative_difference(bf16.y, cpu.y), kBf16);
    EXPECT_LE(relative_difference(bf16.da, cpu.da), kBf16);
    EXPECT_LE(relative_difference(bf16.dscale, cpu.dscale), kBf16);
    EXPECT_NEAR(double(bf16.clipped), double(cpu.clipped), 0.01 * double(cpu.clipped));
  }
}

// A residual LayerNorm read only by quantizers (QAT: the next layer's input and the residual add's), the
// quantizers in its forward kernel (dropout_add_layer_norm_each), against dropout_add_layer_norm and
// fake_quantize_each in sequence on the same GPU: in FP32 and BF16 the same outputs and gradients bit for bit,
// the scale gradients within kReduction, the same saturation counts; the CPU's outputs within a quantization
// step in FP32 (a value at a rounding boundary may land a step apart; BF16 rounds the output first, as the
// model stores it, so against the CPU only the ops in sequence are its reference). Rows of 64 (several a
// block), 768 (many blocks: the scale gradients' partials) and 45 (the ops in sequence on the GPU too); with
// and without the add's input quantizer, dropout and without, one output, an output nothing reads, and
// evaluation.
TEST_F(CudaOps, DropoutAddLayerNormEachEqualsTheOpsInSequence) {
  struct Run {
    std::vector<std::vector<float>> y;
    std::vector<float> da, db, dgamma, dbeta, dscale;
    std::vector<int64_t> clipped;
  };
  struct Case {
    Shape shape;
    double p;
    bool training, add_quantizer;
    int outputs;        // 1 or 2
    bool second_unread;  // the second output takes no gradient
  };
  auto run = [](const Device& device, const Case& k, bool fused) {
    const int64_t n = k.shape.numel(), c = k.shape.last();
    std::vector<float> a = random_values(n, 41, 1.0f), b = random_values(n, 42, 1.0f);
    for (float& v : a) v = bf16_representable(v);
    for (float& v : b) v = bf16_representable(v);
    std::vector<float> gamma = random_values(c, 43, 0.5f), beta = random_values(c, 44, 0.5f);
    for (float& v : gamma) v += 1.0f;
    // Each quantizer saturates some elements: the add's of a (|a| up to 1), the outputs' (ranges 2.5 and 3)
    // of y (|y| up to about 4).
    const std::vector<float> scales = {0.01f, 0.02f, 0.024f};
    Graph<float> g(device);
    DeviceBuffer av(device, n * 4), ag(device, n * 4), bv(device, n * 4), bg(device, n * 4), gv(device, c * 4),
        gg(device, c * 4), tv(device, c * 4), tg(device, c * 4), sv(device, 12), sg(device, 12), counters(device, 24);
    device.copy_to_device(av.data(), a.data(), n * 4);
    device.copy_to_device(bv.data(), b.data(), n * 4);
    device.copy_to_device(gv.data(), gamma.data(), c * 4);
    device.copy_to_device(tv.data(), beta.data(), c * 4);
    device.copy_to_device(sv.data(), scales.data(), 12);
    for (DeviceBuffer* d : {&ag, &bg}) device.fill_zero(d->data(), n * 4);
    for (DeviceBuffer* d : {&gg, &tg}) device.fill_zero(d->data(), c * 4);
    device.fill_zero(sg.data(), 12);
    device.fill_zero(counters.data(), 24);
    const Shape shape = k.shape;
    Var ain = g.leaf(TensorView<float>(av.as<float>(), shape), TensorView<float>(ag.as<float>(), shape));
    Var bin = g.leaf(TensorView<float>(bv.as<float>(), shape), TensorView<float>(bg.as<float>(), shape));
    Var gamma_in = g.leaf(TensorView<float>(gv.as<float>(), Shape{c}), TensorView<float>(gg.as<float>(), Shape{c}));
    Var beta_in = g.leaf(TensorView<float>(tv.as<float>(), Shape{c}), TensorView<float>(tg.as<float>(), Shape{c}));
    std::vector<ops::QuantizeOutput> q;
    for (int i = 0; i < 3; ++i) {
      Var s = g.leaf(TensorView<float>(sv.as<float>() + i, Shape{1}), TensorView<float>(sg.as<float>() + i, Shape{1}));
      q.push_back(ops::QuantizeOutput{s, -128, 127, 0.3 + 0.1 * i, counters.as<int64_t>() + i});
    }
    const std::span<const ops::QuantizeOutput> outputs(q.data() + 1, size_t(k.outputs));
    Rng rng(93);
    rng.reserve(5);
    std::vector<Var> ys;
    if (fused) {
      ys = ops::dropout_add_layer_norm_each(g, ain, bin, gamma_in, beta_in, 1e-12, k.p, k.training, rng,
                                            k.add_quantizer ? &q[0] : nullptr, outputs);
    } else {
      const Var y = k.add_quantizer
                        ? ops::dropout_add_layer_norm(g, ain, bin, gamma_in, beta_in, 1e-12, k.p, k.training, rng, q[0])
                        : ops::dropout_add_layer_norm(g, ain, bin, gamma_in, beta_in, 1e-12, k.p, k.training, rng);
      ys = ops::fake_quantize_each(g, y, outputs);
    }
    Run r;
    Var loss;
    for (size_t i = 0; i < ys.size(); ++i) {
      r.y.push_back(g.to_host(ys[i]));
      if (i == 1 && k.second_unread) continue;
      const Var term =
          ops::sum(g, ops::mul(g, ys[i], g.input(std::span<const float>(random_values(n, 45 + int(i))), shape)));
      loss = loss.valid() ? ops::add(g, loss, term) : term;
    }
    g.backward(loss);
    r.da.resize(n), r.db.resize(n), r.dgamma.resize(c), r.dbeta.resize(c), r.dscale.resize(3), r.clipped.resize(3);
    device.copy_to_host(r.da.data(), ag.data(), n * 4);
    device.copy_to_host(r.db.data(), bg.data(), n * 4);
    device.copy_to_host(r.dgamma.data(), gg.data(), c * 4);
    device.copy_to_host(r.dbeta.data(), tg.data(), c * 4);
    device.copy_to_host(r.dscale.data(), sg.data(), 12);
    device.copy_to_host(r.clipped.data(), counters.data(), 24);
    return r;
  };
  for (const Case& k : {Case{{3, 7, 64}, 0.1, true, true, 2, false}, Case{{600, 768}, 0.1, true, true, 2, false},
                        Case{{3, 7, 45}, 0.1, true, true, 2, false}, Case{{64, 256}, 0.0, true, false, 2, false},
                        Case{{64, 256}, 0.1, true, false, 1, false}, Case{{64, 768}, 0.1, true, true, 2, true},
                        Case{{64, 256}, 0.1, false, true, 2, false}}) {
    SCOPED_TRACE(k.shape.str() + " p " + std::to_string(k.p) + (k.training ? "" : " evaluation") +
                 (k.add_quantizer ? " add quantizer" : "") + " outputs " + std::to_string(k.outputs) +
                 (k.second_unread ? " (the second unread)" : ""));
    const Run cpu = run(Device::cpu(), k, true);
    for (const Device* device : {gpu_.get(), gpu_bf16_.get()}) {
      const bool bf16 = device == gpu_bf16_.get();
      SCOPED_TRACE(bf16 ? "BF16" : "FP32");
      const Run separate = run(*device, k, false), fused = run(*device, k, true);
      ASSERT_EQ(fused.y.size(), size_t(k.outputs));
      for (int o = 0; o < k.outputs; ++o) {
        EXPECT_LE(relative_difference(fused.y[o], separate.y[o]), kExact);
        if (bf16) continue;
        const float step = o == 0 ? 0.02f : 0.024f;  // the outputs' scales
        int64_t apart = 0;
        for (size_t i = 0; i < cpu.y[o].size(); ++i) {
          const float d = std::abs(fused.y[o][i] - cpu.y[o][i]);
          EXPECT_LE(d, 1.001f * step) << "output " << o << " element " << i;
          apart += d > 0.5f * step;
        }
        EXPECT_LE(apart, int64_t(cpu.y[o].size()) / 100) << "output " << o << ": elements a step apart";
      }
      EXPECT_LE(relative_difference(fused.da, separate.da), kExact);
      EXPECT_LE(relative_difference(fused.db, separate.db), kExact);
      EXPECT_LE(relative_difference(fused.dgamma, separate.dgamma), kExact);
      EXPECT_LE(relative_difference(fused.dbeta, separate.dbeta), kExact);
      EXPECT_LE(relative_difference(fused.dscale, separate.dscale), kReduction);
      EXPECT_EQ(fused.clipped, separate.clipped);
    }
    for (int o = 0; o < k.outputs; ++o) EXPECT_GT(cpu.clipped[1 + o], 0) << "output " << o;
  }
}

// Several weights fake-quantized per channel in one op (fake_quantize_many: one launch each way on the GPU)
// against one fake_quantize each on the same device: outputs, input gradients and saturation counts bit
// for bit, in FP32 and BF16, the scale gradients within kReduction (a warp's sum against a block's); and
// the CPU's within kReduction (kBf16 for the BF16 run's scale gradients). Rows of 768 (packs of 4) and 45
// (one at a time), an output nothing reads, an input without a gradient, tensors the op reorders (longest
// rows first: the rows of 96 before those of 45); and a row longer than a block (5,000), where the op
// quantizes one tensor at a time.
TEST_F(CudaOps, FakeQuantizeManyEqualsOneFakeQuantizeEach) {
  struct Run {
    std::vector<float> y, dx, dscale;
    std::vector<int64_t> clipped;
  };
  auto run = [](const Device& device, const std::vector<Shape>& shapes, bool many) {
    const int k = static_cast<int>(shapes.size());
    Graph<float> g(device);
    std::vector<DeviceBuffer> buffers;
    auto buffer = [&](const std::vector<float>& host) {
      buffers.emplace_back(device, host.size() * 4);
      device.copy_to_device(buffers.back().data(), host.data(), host.size() * 4);
      return buffers.back().as<float>();
    };
    DeviceBuffer counters(device, 8 * k);
    device.fill_zero(counters.data(), 8 * k);
    std::vector<ops::QuantizeInput> inputs;
    std::vector<float*> dx, ds;
    for (int t = 0; t < k; ++t) {
      const Shape& shape = shapes[t];
      const int64_t n = shape.numel(), channels = shape[0];
      std::vector<float> scales(channels);
      for (int64_t c = 0; c < channels; ++c) scales[c] = 0.004f + 0.002f * float((c + t) % 7);
      float* xv = buffer(random_values(n, 60 + t, 0.5f));
      dx.push_back(buffer(std::vector<float>(n, 0.0f)));
      float* sv = buffer(scales);
      ds.push_back(buffer(std::vector<float>(channels, 0.0f)));
      const Var x = t == 1 ? g.constant(TensorView<float>(xv, shape))  // takes no gradient
                           : g.leaf(TensorView<float>(xv, shape), TensorView<float>(dx.back(), shape));
      const Var s = g.leaf(TensorView<float>(sv, Shape{channels}), TensorView<float>(ds.back(), Shape{channels}));
      inputs.push_back({x, ops::QuantizeOutput{s, -127, 127, 0.1 * (t + 1), counters.as<int64_t>() + t}});
    }
    std::vector<Var> ys;
    if (many) {
      ys = ops::fake_quantize_many(g, std::span<const ops::QuantizeInput>(inputs));
    } else {
      for (const ops::QuantizeInput& in : inputs)
        ys.push_back(ops::fake_quantize(g, in.x, in.q.scale, in.q.qmin, in.q.qmax, in.q.grad_scale, in.q.clipped));
    }
    Run r;
    Var loss;
    for (int t = 0; t < k; ++t) {
      const std::vector<float> y = g.to_host(ys[t]);
      r.y.insert(r.y.end(), y.begin(), y.end());
      if (t == 2) continue;  // nothing reads this output
      const std::vector<float> up = random_values(shapes[t].numel(), 70 + t);
      const Var term = ops::sum(g, ops::mul(g, ys[t], g.input(std::span<const float>(up), shapes[t])));
      loss = loss.valid() ? ops::add(g, loss, term) : term;
    }
    g.backward(loss);
    r.clipped.resize(k);
    device.copy_to_host(r.clipped.data(), counters.data(), 8 * k);
    for (int t = 0; t < k; ++t) {
      std::vector<float> d(shapes[t].numel()), s(shapes[t][0]);
      device.copy_to_host(d.data(), dx[t], d.size() * 4);
      device.copy_to_host(s.data(), ds[t], s.size() * 4);
      r.dx.insert(r.dx.end(), d.begin(), d.end());
      r.dscale.insert(r.dscale.end(), s.begin(), s.end());
    }
    return r;
  };
  const std::vector<Shape> layer = {Shape{96, 768}, Shape{96, 768}, Shape{40, 768}, Shape{33, 45}, Shape{768, 96}};
  const std::vector<Shape> long_rows = {Shape{4, 5000}, Shape{8, 768}, Shape{8, 768}};
  for (const auto* shapes : {&layer, &long_rows}) {
    SCOPED_TRACE(shapes == &layer ? "a layer's weights" : "a row longer than a block");
    const Run cpu = run(Device::cpu(), *shapes, false);
    for (const Device* device : {gpu_.get(), gpu_bf16_.get()}) {
      SCOPED_TRACE(device == gpu_.get() ? "fp32" : "bf16");
      const Run one = run(*device, *shapes, false), many = run(*device, *shapes, true);
      EXPECT_LE(relative_difference(many.y, one.y), kExact);
      EXPECT_LE(relative_difference(many.dx, one.dx), kExact);
      EXPECT_LE(relative_difference(many.dscale, one.dscale), kReduction);
      EXPECT_EQ(many.clipped, one.clipped);
      EXPECT_LE(relative_difference(many.dscale, cpu.dscale), device == gpu_.get() ? kReduction : kBf16);
      EXPECT_EQ(many.clipped, cpu.clipped);
    }
    EXPECT_GT(cpu.clipped[0], 0);
  }
}

// Several quantizers reading one input in one op, against one fake_quantize each on the CPU: outputs
// bit for bit in FP32; the input's gradient (a sum of up to four straight-through terms, added in another
// order) and the scale gradients within kReduction; in BF16 within kBf16. Also with an output that nothing
// reads (no gradient, no scale gradient) and with an odd size.
TEST_F(CudaOps, FakeQuantizeEachEqualsOneFakeQuantizePerQuantizer) {
  const std::vector<float> scale_values = {0.02f, 0.011f, 0.05f, 0.007f};
  struct Run {
    std::vector<float> y, dx, dscale;
    std::vector<int64_t> clipped;
  };
  auto run = [&](const Device& device, int64_t n, bool skip_one) {
    std::vector<float> x = random_values(n, 21, 1.5f);
    for (float& v : x) v = bf16_representable(v);
    Graph<float> g(device);
    DeviceBuffer xv(device, n * 4), xg(device, n * 4), sv(device, 16), sg(device, 16), counters(device, 32);
    device.copy_to_device(xv.data(), x.data(), n * 4);
    device.copy_to_device(sv.data(), scale_values.data(), 16);
    device.fill_zero(xg.data(), n * 4);
    device.fill_zero(sg.data(), 16);
    device.fill_zero(counters.data(), 32);
    Var xin = g.leaf(TensorView<float>(xv.as<float>(), Shape{n}), TensorView<float>(xg.as<float>(), Shape{n}));
    std::vector<ops::QuantizeOutput> qs;
    for (int q = 0; q < 4; ++q) {
      Var s = g.leaf(TensorView<float>(sv.as<float>() + q, Shape{1}), TensorView<float>(sg.as<float>() + q, Shape{1}));
      qs.push_back({s, q == 3 ? -127 : -128, 127, 0.1 * (q + 1), counters.as<int64_t>() + q});
    }
    const std::vector<Var> ys = ops::fake_quantize_each(g, xin, std::span<const ops::QuantizeOutput>(qs));
    Run r;
    Var loss;
    for (int q = 0; q < 4; ++q) {
      const std::vector<float> y = g.to_host(ys[q]);
      r.y.insert(r.y.end(), y.begin(), y.end());
      if (skip_one && q == 1) continue;  // nothing reads this output
      const std::vector<float> up = random_values(n, 30 + q);
      Var term = ops::sum(g, ops::mul(g, ys[q], g.input(std::span<const float>(up), Shape{n})));
      loss = loss.valid() ? ops::add(g, loss, term) : term;
    }
    g.backward(loss);
    r.dx.resize(n);
    r.dscale.resize(4);
    r.clipped.resize(4);
    device.copy_to_host(r.dx.data(), xg.data(), n * 4);
    device.copy_to_host(r.dscale.data(), sg.data(), 16);
    device.copy_to_host(r.clipped.data(), counters.data(), 32);
    return r;
  };
  for (int64_t n : {int64_t{3} * 40000, int64_t{1001}})
    for (bool skip_one : {false, true}) {
      SCOPED_TRACE(std::to_string(n) + (skip_one ? ", one output unread" : ""));
      const Run cpu = run(Device::cpu(), n, skip_one), gpu = run(*gpu_, n, skip_one),
                bf16 = run(*gpu_bf16_, n, skip_one);
      EXPECT_LE(relative_difference(gpu.y, cpu.y), kExact);
      EXPECT_LE(relative_difference(gpu.dx, cpu.dx), kReduction);
      EXPECT_LE(relative_difference(gpu.dscale, cpu.dscale), kReduction);
      EXPECT_EQ(gpu.clipped, cpu.clipped);
      EXPECT_GT(cpu.clipped[3], 0);
      if (skip_one) {
        EXPECT_EQ(cpu.dscale[1], 0.0f);
      }
      EXPECT_LE(relative_difference(bf16.y, cpu.y), kBf16);
      EXPECT_LE(relative_difference(bf16.dx, cpu.dx), kBf16);
      EXPECT_LE(relative_difference(bf16.dscale, cpu.dscale), kBf16);
      EXPECT_EQ(bf16.clipped, cpu.clipped);
    }
}

// Add, mul and scale keep their inputs' dtype, so the comparisons above (F32 leaves) run them in F32
// only; here their inputs are BF16 activations (GELU outputs) in the BF16 pass.
// The integer linear on the GPU (int8 tensor cores, int32 sums, then the CPU's epilogue: our wgmma GEMM with
// the epilogue inside on an H100 or H200, and cuBLASLt's with a kernel after it) against the CPU integer
// engine on the same integers: in FP32 bit for bit, with and without bias, at odd sizes and partial tiles
// (rows, channels, 16-byte pieces of a row), 2,500 inputs and 40,000 (int32 sums past 2^24), 297 tiles of 128 x 128
// (more than two waves of one-tile blocks on an H100: the ping-pong kernel, two warpgroups a side; partial tiles
// at both edges), 288 of 1,000 inputs (the same, its ring of stages wrapping within tiles) and of 1,100 (one
// warpgroup a side); with GELU equal to
// ops::gelu of its output on the GPU (in FP32); in BF16 the CPU's values rounded to BF16 (inputs BF16-representable, as
// the BF16 graph stores them). The fake-quantized model's exact sums on the GPU (exact_quantized_linear: BF16 tensor
// cores on the integers, slices of 1,024 inputs added in int32) give the same values bit for bit.
TEST_F(CudaOps, Int8LinearEqualsTheCpuEngineBitForBit) {
  struct Size {
    int64_t rows, k, n;
  };
  for (const Size& size :
       {Size{37, 203, 45}, Size{9, 2500, 21}, Size{130, 768, 256}, Size{300, 96, 200}, Size{257, 512, 132},
        Size{5, 40000, 7}, Size{4200, 200, 1100}, Size{2200, 1000, 2000}, Size{2200, 1100, 2000}}) {
    SCOPED_TRACE(std::to_string(size.rows) + "x" + std::to_string(size.k) + "x" + std::to_string(size.n));
    std::vector<float> x = random_values(size.rows * size.k, 5);
    for (float& v : x) v = bf16_representable(v);
    std::mt19937 gen(7);
    std::uniform_int_distribution<int> byte(-128, 127);
    std::uniform_real_distribution<float> uniform(0.001f, 0.01f);
    std::vector<int8_t> w(static_cast<size_t>(size.n * size.k));
    for (int8_t& v : w) v = static_cast<int8_t>(byte(gen));
    std::vector<float> scale_w(static_cast<size_t>(size.n)), bias = random_values(size.n, 9);
    for (float& s : scale_w) s = uniform(gen);
    const float scale_x = 3.0f / 127;  // |x| past 3 saturates
    const Int8Weights packed(w.data(), size.n, size.k);
    auto cpu = [&](bool with_bias, bool gelu) {
      Graph<float> g(Device::cpu());
      NoGradGuard<float> no_grad(g);
      Var xv = g.input(std::span<const float>(x), Shape{size.rows, size.k});
      Var b = with_bias ? g.input(std::span<const float>(bias), Shape{size.n}) : Var{};
      return g.to_host(gelu ? ops::int8_linear_gelu(g, xv, packed, scale_x, scale_w, b)
                            : ops::int8_linear(g, xv, packed, scale_x, scale_w, b));
    };
    for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
      const bool bf16 = gpu->precision() == Precision::kBf16;
      SCOPED_TRACE(bf16 ? "bf16" : "fp32");
      const ops::DeviceInt8Weights with_bias_weights(*gpu, w.data(), scale_w, bias, size.n, size.k),
          no_bias_weights(*gpu, w.data(), scale_w, {}, size.n, size.k);
      auto run = [&](bool with_bias, bool gelu, bool gelu_op,
                     ops::DeviceInt8Gemm gemm = ops::DeviceInt8Gemm::kFastest) {
        Graph<float> g(*gpu);
        NoGradGuard<float> no_grad(g);
        Var xv = g.input(std::span<const float>(x), Shape{size.rows, size.k});
        Var y = ops::int8_linear(g, xv, with_bias ? with_bias_weights : no_bias_weights, scale_x, gelu, gemm);
        return g.to_host(gelu_op ? ops::gelu(g, y) : y);
      };
      for (bool with_bias : {true, false}) {
        std::vector<float> expected = cpu(with_bias, false);
        if (bf16)
          for (float& v : expected) v = bf16_representable(v);
        EXPECT_EQ(run(with_bias, false, false), expected) << "bias " << with_bias;
        EXPECT_EQ(run(with_bias, false, false, ops::DeviceInt8Gemm::kCublasLt), expected) << "cuBLASLt " << with_bias;
      }
      EXPECT_EQ(run(true, true, false, ops::DeviceInt8Gemm::kCublasLt), run(true, true, false)) << "cuBLASLt, GELU";
      // The fake-quantized model's exact sums (BF16 tensor cores on the integers): the same values.
      std::vector<float> x_fake(x.size()), w_fake(w.size());
      for (size_t i = 0; i < x.size(); ++i)
        x_fake[i] = std::clamp(std::nearbyint(x[i] / scale_x), -128.0f, 127.0f) * scale_x;
      for (size_t i = 0; i < w.size(); ++i) w_fake[i] = float(w[i]) * scale_w[i / size.k];
      for (bool gelu : {false, true}) {
        Graph<float> g(*gpu);
        NoGradGuard<float> no_grad(g);
        Var y = ops::exact_quantized_linear(g, g.input(std::span<const float>(x_fake), Shape{size.rows, size.k}),
                                            scale_x, g.input(std::span<const float>(w_fake), Shape{size.n, size.k}),
                                            scale_w, g.input(std::span<const float>(bias), Shape{size.n}), gelu);
        EXPECT_EQ(g.to_host(y), run(true, gelu, false)) << "exact_quantized_linear, gelu " << gelu;
      }
      if (!bf16) {  // (in BF16 ops::gelu reads the product rounded to BF16; the epilogue applies GELU before)
        EXPECT_EQ(run(true, true, false), run(true, false, true)) << "GELU in the epilogue vs ops::gelu";
      }
      EXPECT_LE(relative_difference(run(true, true, false), cpu(true, true)), bf16 ? kBf16 : kElementwise);
    }
  }
  // Inference only, and the weights' own device.
  const std::vector<int8_t> w(12, 1);
  const std::vector<float> x(6, 1.0f), scale_w(4, 0.5f);
  const ops::DeviceInt8Weights weights(*gpu_, w.data(), scale_w, {}, 4, 3);
  EXPECT_THROW(ops::DeviceInt8Weights(*gpu_, w.data(), std::span<const float>(scale_w).first(3), {}, 4, 3),
               std::exception);
  Graph<float> g(*gpu_);
  Var xv = g.input(std::span<const float>(x), Shape{2, 3});
  EXPECT_THROW(ops::int8_linear(g, xv, weights, 0.1f), std::exception);
  Graph<float> cpu_graph(Device::cpu());
  NoGradGuard<float> no_grad(cpu_graph);
  EXPECT_THROW(ops::int8_linear(cpu_graph, cpu_graph.input(std::span<const float>(x), Shape{2, 3}), weights, 0.1f),
               std::exception);
}

// quantized_linear, QAT's linear on a GPU, on fake-quantized x (per tensor) and weight (per output channel):
// where the Hopper int8 GEMM runs, its forward is the integer engine's value fma(float(exact sum), scale_x *
// scale_w[c], bias[c]) bit for bit (in BF16 that rounded to BF16) and in FP32 within kGemm of linear's on the
// same floats; elsewhere (inputs not a multiple of 16, other GPUs) linear's own. Its gradients are linear's,
// bit for bit, in FP32 and BF16. Odd rows and outputs, 1,024 inputs (eight slices of K), 4,400 rows of 1,024
// outputs (the ping-pong kernel), no bias.
TEST_F(CudaOps, QuantizedLinearSumsTheIntegersAndBackpropagatesAsLinear) {
  const std::vector<int8_t> probe(256, 1);
  const std::vector<float> probe_scales(16, 1.0f);
  const bool wgmma = ops::DeviceInt8Weights(*gpu_, probe.data(), probe_scales, {}, 16, 16).tensor_map() != nullptr;
  std::cout << "[ info ] the Hopper int8 GEMM " << (wgmma ? "runs" : "does not run") << " here\n";
  struct Size {
    int64_t rows, in, out;
  };
  for (const Size& size : {Size{37, 48, 45}, Size{300, 768, 200}, Size{4200, 1024, 296}, Size{4400, 256, 1024},
                           Size{130, 3072, 768}, Size{9, 40, 21}}) {
    SCOPED_TRACE(std::to_string(size.rows) + "x" + std::to_string(size.in) + "x" + std::to_string(size.out));
    const float scale_x = 3.0f / 127;  // |x| past 3 saturates
    std::mt19937 gen(7);
    std::uniform_real_distribution<float> uniform(0.001f, 0.01f);
    std::vector<float> scale_w(static_cast<size_t>(size.out));
    for (float& v : scale_w) v = uniform(gen);
    std::vector<float> x = random_values(size.rows * size.in, 5), w = random_values(size.out * size.in, 6, 0.3f);
    std::vector<int32_t> qx(x.size()), qw(w.size());
    for (size_t i = 0; i < x.size(); ++i) {
      qx[i] = int32_t(std::clamp(std::nearbyint(x[i] / scale_x), -128.0f, 127.0f));
      x[i] = float(qx[i]) * scale_x;
    }
    for (size_t i = 0; i < w.size(); ++i) {
      const float s = scale_w[i / size.in];
      qw[i] = int32_t(std::clamp(std::nearbyint(w[i] / s), -127.0f, 127.0f));
      w[i] = float(qw[i]) * s;
    }
    const std::vector<float> bias = random_values(size.out, 9);
    // The integer engine's values.
    std::vector<float> engine(static_cast<size_t>(size.rows * size.out)), engine_no_bias(engine.size());
    for (int64_t r = 0; r < size.rows; ++r)
      for (int64_t c = 0; c < size.out; ++c) {
        int32_t sum = 0;
        for (int64_t i = 0; i < size.in; ++i) sum += qx[r * size.in + i] * qw[c * size.in + i];
        engine[r * size.out + c] = std::fma(float(sum), scale_x * scale_w[c], bias[c]);
        engine_no_bias[r * size.out + c] = std::fma(float(sum), scale_x * scale_w[c], 0.0f);
      }
    const bool integers = wgmma && size.in % 16 == 0;
    for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
      const bool bf16 = gpu->precision() == Precision::kBf16;
      SCOPED_TRACE(bf16 ? "bf16" : "fp32");
      for (bool with_bias : {true, false}) {
        SCOPED_TRACE(with_bias ? "bias" : "no bias");
        auto run = [&](bool quantized) {
          return run_on(
              *gpu, {Shape{size.rows, size.in}, Shape{size.out, size.in}, Shape{size.out}, Shape{1}, Shape{size.out}},
              {x, w, bias, {scale_x}, scale_w}, {true, true, with_bias, false, false},
              [&](Graph<float>& g, const std::vector<Var>& in) {
                const Var b = with_bias ? in[2] : Var{};
                return quantized ? ops::quantized_linear(g, in[0], in[1], b, in[3], in[4])
                                 : ops::linear(g, in[0], in[1], b);
              },
              99);
        };
        const Result q = run(true), plain = run(false);
        for (size_t i = 0; i < 3; ++i) EXPECT_EQ(q.grads[i], plain.grads[i]) << "gradient of input " << i;
        if (!integers) {
          EXPECT_EQ(q.value, plain.value) << "linear itself";
          continue;
        }
        std::vector<float> expected = with_bias ? engine : engine_no_bias;
        if (bf16)
          for (float& v : expected) v = bf16_representable(v);
        EXPECT_EQ(q.value, expected) << "the integer engine's values";
        if (!bf16) {
          EXPECT_LE(relative_difference(q.value, plain.value), kGemm) << "linear's, up to float rounding";
        }
      }
    }
  }
  // One input scale and one weight scale per output channel.
  Graph<float> g(*gpu_);
  const std::vector<float> x(6, 1.0f), w(12, 0.5f), s(4, 0.5f);
  const Var xv = g.input(std::span<const float>(x), Shape{2, 3}), wv = g.input(std::span<const float>(w), Shape{4, 3});
  EXPECT_THROW(ops::quantized_linear(g, xv, wv, Var{}, g.input(std::span<const float>(s), Shape{4}),
                                     g.input(std::span<const float>(s), Shape{4})),
               std::exception);
  EXPECT_THROW(ops::quantized_linear(g, xv, wv, Var{}, g.input(std::span<const float>(s).first(1), Shape{1}),
                                     g.input(std::span<const float>(s).first(3), Shape{3})),
               std::exception);
}

// The integers a quantizer writes beside its values where asked (QuantizeOutput::integers, Graph::integers):
// the fake-quantized values are those integers times the scale, in FP32 and BF16, from fake_quantize, the
// quantized GELU, a LayerNorm's two quantized outputs and fake_quantize_many (per output channel); none
// where not asked; quantized_linear reading them gives, bit for bit, what it gives dividing them back out.
TEST_F(CudaOps, QuantizersWriteTheIntegersBehindTheirValuesWhereAsked) {
  const int64_t rows = 64, c = 256, out = 48;
  const std::vector<float> x = random_values(rows * c, 3), x2 = random_values(rows * c, 8),
                           w = random_values(out * c, 4, 0.05f), gamma = random_values(c, 5),
                           beta = random_values(c, 6), bias = random_values(out, 7);
  std::vector<float> w_scales(static_cast<size_t>(out));
  for (int64_t i = 0; i < out; ++i) w_scales[i] = 0.0004f + 0.00001f * float(i);  // some weights saturate
  for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
    const bool bf16 = gpu->precision() == Precision::kBf16;
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    Graph<float> g(*gpu);
    NoGradGuard<float> no_grad(g);
    const Var xv = g.input(std::span<const float>(x), Shape{rows, c});
    const std::vector<float> one{0.02f};
    const Var scale = g.input(std::span<const float>(one), Shape{1});
    const ops::QuantizeOutput q{scale, -128, 127, 1.0, nullptr, /*integers=*/true};
    const ops::QuantizeOutput q_none{scale, -128, 127, 1.0, nullptr, /*integers=*/false};
    Rng rng(1);
    const std::vector<Var> norms = ops::dropout_add_layer_norm_each(
        g, xv, g.input(std::span<const float>(x2), Shape{rows, c}), g.input(std::span<const float>(gamma), Shape{c}),
        g.input(std::span<const float>(beta), Shape{c}), 1e-12, 0.0, false, rng, nullptr,
        std::vector<ops::QuantizeOutput>{q, q_none});
    const Var w_scale = g.input(std::span<const float>(w_scales), Shape{out});
    ops::QuantizeInput weight{g.input(std::span<const float>(w), Shape{out, c}),
                              {w_scale, -127, 127, 1.0, nullptr, true}};
    const Var wq = ops::fake_quantize_many(g, std::span<const ops::QuantizeInput>(&weight, 1))[0];
    struct Made {
      const char* what;
      Var y;
      const float* scales;
      int64_t per_scale;
    };
    const std::vector<Made> made = {
        {"fake_quantize", ops::fake_quantize(g, xv, scale, -128, 127, 1.0, nullptr, true), one.data(), rows * c},
        {"gelu", ops::gelu(g, xv, q), one.data(), rows * c},
        {"layer norm", norms[0], one.data(), rows * c},
        {"fake_quantize_many", wq, w_scales.data(), c}};
    for (const Made& m : made) {
      SCOPED_TRACE(m.what);
      ASSERT_NE(g.integers(m.y), nullptr);
      const std::vector<float> values = g.to_host(m.y);
      std::vector<int8_t> integers(values.size());
      gpu->copy_to_host(integers.data(), g.integers(m.y), integers.size());
      int64_t saturated = 0, apart = 0;
      for (size_t i = 0; i < values.size(); ++i) {
        const float v = float(integers[i]) * m.scales[i / m.per_scale];
        apart += values[i] != (bf16 ? bf16_representable(v) : v);
        saturated += integers[i] == 127 || integers[i] <= -127;
      }
      EXPECT_EQ(apart, 0) << "values that are not their integers times the scale";
      EXPECT_GT(saturated, 0) << "the scale saturates some values";
    }
    EXPECT_EQ(g.integers(norms[1]), nullptr) << "an output that asked for none";
    EXPECT_EQ(g.integers(ops::fake_quantize(g, xv, scale, -128, 127)), nullptr);
    // quantized_linear on the integers and on the same values without them (a copy the scale op makes).
    for (const Made& m : {made[0], made[1], made[2]}) {
      SCOPED_TRACE(m.what);
      const Var b = g.input(std::span<const float>(bias), Shape{out});
      const Var with = ops::quantized_linear(g, m.y, wq, b, scale, w_scale);
      const Var without = ops::quantized_linear(g, ops::scale(g, m.y, 1.0), ops::scale(g, wq, 1.0), b, scale, w_scale);
      EXPECT_EQ(g.to_host(with), g.to_host(without));
    }
  }
}

// The consumers' quantizers in the integer linear's epilogue (int8_linear_quantized) against the ops one by
// one on the GPU: int8_linear's output (stored in the activations' dtype), each part of its columns
// fake-quantized by ops::fake_quantize, or with GELU by ops::gelu with the quantizer fused (which
// quantizes the FP32 GELU of the stored value), bit for bit, in FP32 and BF16, with our wgmma GEMM and
// cuBLASLt's; the int8 outputs are those integers (the fake-quantized values divided by the scale), and an
// int8_linear reading them gives the values it gives reading the fake-quantized values. Parts of odd
// widths (16-byte pieces cut across parts and rows), an unquantized part, inputs of 200 (rows padded to
// 208 bytes when the integers are read); one part with GELU into int8 in BF16 (the wgmma epilogue's lookup
// table, Int8Epilogue::table); 4,300 rows in parts ending on 128-column tiles and in parts that do not, with 200
// inputs (the ping-pong kernel, two warpgroups a side) and 1,030 (one warpgroup a side), and in one part (the
// lookup table) with each.
TEST_F(CudaOps, Int8LinearQuantizedEqualsTheOpsOneByOne) {
  struct Case {
    int64_t rows, k;
    std::vector<int64_t> columns;
  };
  for (const Case& c :
       {Case{37, 200, {16, 21, 9}}, Case{130, 768, {128, 128, 128}}, Case{300, 96, {72, 64, 64}}, Case{257, 512, {132}},
        Case{4300, 200, {256, 384, 300}}, Case{4300, 200, {900}}, Case{4300, 1030, {256, 384, 300}},
        Case{4300, 1030, {200, 330, 370}}, Case{4300, 1030, {900}}}) {
    int64_t n = 0;
    for (int64_t w : c.columns) n += w;
    SCOPED_TRACE(std::to_string(c.rows) + "x" + std::to_string(c.k) + "x" + std::to_string(n));
    std::vector<float> x = random_values(c.rows * c.k, 5);
    for (float& v : x) v = bf16_representable(v);
    std::mt19937 gen(11);
    std::uniform_int_distribution<int> byte(-128, 127);
    std::uniform_real_distribution<float> uniform(0.001f, 0.01f);
    std::vector<int8_t> w(static_cast<size_t>(n * c.k));
    for (int8_t& v : w) v = static_cast<int8_t>(byte(gen));
    std::vector<float> scale_w(static_cast<size_t>(n)), bias = random_values(n, 9);
    for (float& s : scale_w) s = uniform(gen);
    const float scale_x = 3.0f / 127;
    std::vector<ops::Int8OutputPart> parts;
    for (size_t p = 0; p < c.columns.size(); ++p)  // scales near the outputs' spread: some saturate
      parts.push_back({c.columns[p], 0.004f * float(p + 1)});
    for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
      const bool bf16 = gpu->precision() == Precision::kBf16;
      SCOPED_TRACE(bf16 ? "bf16" : "fp32");
      const ops::DeviceInt8Weights weights(*gpu, w.data(), scale_w, bias, n, c.k);
      for (bool gelu : {false, true})
        for (ops::DeviceInt8Gemm gemm : {ops::DeviceInt8Gemm::kFastest, ops::DeviceInt8Gemm::kCublasLt}) {
          SCOPED_TRACE(std::string(gelu ? "gelu" : "no gelu") +
                       (gemm == ops::DeviceInt8Gemm::kCublasLt ? ", cuBLASLt" : ""));
          Graph<float> g(*gpu);
          NoGradGuard<float> no_grad(g);
          const Var xv = g.input(std::span<const float>(x), Shape{c.rows, c.k});
          const std::vector<float> y = g.to_host(ops::int8_linear(g, xv, weights, scale_x, false, gemm));
          const std::vector<Var> fake = ops::int8_linear_quantized(g, xv, weights, scale_x, gelu, parts, false, gemm);
          const std::vector<Var> integers =
              ops::int8_linear_quantized(g, xv, weights, scale_x, gelu, parts, true, gemm);
          ASSERT_EQ(fake.size(), parts.size());
          int64_t first = 0;
          for (size_t p = 0; p < parts.size(); ++p) {
            const int64_t width = parts[p].columns;
            std::vector<float> part(static_cast<size_t>(c.rows * width));
            for (int64_t r = 0; r < c.rows; ++r)
              std::copy_n(y.begin() + r * n + first, width, part.begin() + r * width);
            first += width;
            const float s = parts[p].scale;
            const Var stored = g.input(std::span<const float>(part), Shape{c.rows, width});
            const Var scale = g.input(std::span<const float>(&s, 1), Shape{1});
            const Var expected = gelu ? ops::gelu(g, stored, ops::QuantizeOutput{scale})
                                      : ops::fake_quantize(g, stored, scale, -128, 127);
            const std::vector<float> want = g.to_host(expected);
            EXPECT_EQ(g.dtype(fake[p]), g.activation_dtype());
            EXPECT_EQ(g.shape(fake[p]), Shape({c.rows, width}));
            EXPECT_EQ(g.to_host(fake[p]), want) << "part " << p;
            EXPECT_EQ(g.dtype(integers[p]), DType::kS8);
            std::vector<float> divided(want.size());
            for (size_t i = 0; i < want.size(); ++i) divided[i] = std::nearbyint(want[i] / s);
            EXPECT_EQ(g.to_host(integers[p]), divided) << "part " << p;
            // The integers read by the next integer linear: its values from the fake-quantized input.
            const ops::DeviceInt8Weights next(*gpu, w.data(), std::span<const float>(scale_w).first(8),
                                              std::span<const float>(bias).first(8), 8, width);
            EXPECT_EQ(g.to_host(ops::int8_linear(g, integers[p], next, s, false, gemm)),
                      g.to_host(ops::int8_linear(g, fake[p], next, s, false, gemm)))
                << "part " << p;
          }
        }
      // An unquantized part gives int8_linear's values; int8 outputs need every part quantized.
      Graph<float> g(*gpu);
      NoGradGuard<float> no_grad(g);
      const Var xv = g.input(std::span<const float>(x), Shape{c.rows, c.k});
      std::vector<ops::Int8OutputPart> plain = {{n, 0.0f}};
      EXPECT_EQ(g.to_host(ops::int8_linear_quantized(g, xv, weights, scale_x, true, plain, false)[0]),
                g.to_host(ops::int8_linear(g, xv, weights, scale_x, true)));
      EXPECT_THROW(ops::int8_linear_quantized(g, xv, weights, scale_x, false, plain, true), std::exception);
      plain[0].columns = n - 1;
      EXPECT_THROW(ops::int8_linear_quantized(g, xv, weights, scale_x, false, plain, false), std::exception);
    }
  }
}

// The GELU table a prepared model makes once (ops::DeviceGeluTable): its entry for every finite BF16 value is
// the integer ops::gelu with the quantizer fused gives that value; a GELU part handed it gives the integers the
// linear gives making its own table for the call, bit for bit, with the wgmma GEMM's one-tile and ping-pong
// schedules (37 and 4,300 rows); where that GEMM runs the part reads it (the same table zeroed: every output
// 0); a table at another scale is left unused. Outputs of every magnitude at scales from 2^-24 to 2^24 give
// ops::gelu's integers, the ping-pong kernel's window of the table (34,000 rows) included.
TEST_F(CudaOps, Int8LinearQuantizedReadsThePreparedGeluTable) {
  const Device& gpu = *gpu_bf16_;
  const float s = 0.004f;
  const ops::DeviceGeluTable table(gpu, s);
  EXPECT_EQ(table.scale(), s);
  {
    std::vector<float> values;
    std::vector<int> bits;
    for (int b = 0; b < 65536; ++b) {
      const uint32_t word = uint32_t(b) << 16;
      float v;
      std::memcpy(&v, &word, 4);
      if (std::isfinite(v)) values.push_back(v), bits.push_back(b);
    }
    std::vector<int8_t> entries(65536);
    gpu.copy_to_host(entries.data(), table.data(), entries.size());
    Graph<float> g(gpu);
    NoGradGuard<float> no_grad(g);
    const Var x = g.input(std::span<const float>(values), Shape{int64_t(values.size())});
    const Var scale = g.input(std::span<const float>(&s, 1), Shape{1});
    const std::vector<float> want = g.to_host(ops::gelu(g, x, ops::QuantizeOutput{scale}));
    int64_t wrong = 0;
    for (size_t i = 0; i < values.size(); ++i) wrong += entries[bits[i]] != int8_t(std::nearbyint(want[i] / s));
    EXPECT_EQ(wrong, 0) << "of " << values.size() << " finite BF16 values";
  }
  const ops::DeviceGeluTable other(gpu, 2 * s);
  for (int64_t rows : {37, 4300}) {
    SCOPED_TRACE(std::to_string(rows) + " rows");
    const int64_t k = 200, n = 900;
    std::vector<float> x = random_values(rows * k, 5);
    for (float& v : x) v = bf16_representable(v);
    std::mt19937 gen(11);
    std::uniform_int_distribution<int> byte(-128, 127);
    std::uniform_real_distribution<float> uniform(0.001f, 0.01f);
    std::vector<int8_t> w(static_cast<size_t>(n * k));
    for (int8_t& v : w) v = static_cast<int8_t>(byte(gen));
    std::vector<float> scale_w(static_cast<size_t>(n)), bias = random_values(n, 9);
    for (float& v : scale_w) v = uniform(gen);
    const ops::DeviceInt8Weights weights(gpu, w.data(), scale_w, bias, n, k);
    Graph<float> g(gpu);
    NoGradGuard<float> no_grad(g);
    const Var xv = g.input(std::span<const float>(x), Shape{rows, k});
    auto integers = [&](const ops::DeviceGeluTable* t) {
      const ops::Int8OutputPart part{n, s, t};
      return g.to_host(ops::int8_linear_quantized(g, xv, weights, 3.0f / 127, true,
                                                  std::span<const ops::Int8OutputPart>(&part, 1), true)[0]);
    };
    const std::vector<float> own = integers(nullptr);
    EXPECT_GT(std::count_if(own.begin(), own.end(), [](float v) { return v != 0; }), rows * n / 4);
    EXPECT_EQ(integers(&table), own);
    EXPECT_EQ(integers(&other), own);
    if (weights.tensor_map()) {  // (elsewhere cuBLASLt's GEMM and a dequantizing kernel, no table)
      const ops::DeviceGeluTable zeroed(gpu, s);
      gpu.fill_zero(const_cast<int8_t*>(zeroed.data()), 65536);
      EXPECT_EQ(integers(&zeroed), std::vector<float>(own.size(), 0.0f));
    }
  }
  // Outputs of every magnitude (zero weights: each output its bias), at scales from 2^-24 to 2^24: the Hopper
  // epilogue's window of the table clamps magnitudes outside 2^-31 .. 2^33 to its edges; the integers are
  // still ops::gelu's with the quantizer fused, of the stored BF16 values.
  std::vector<float> bias;
  for (float magnitude : {0.0f, 1e-30f, 1e-12f, 3e-10f, 5e-10f, 1e-6f,  0.01f, 0.3f,  0.75f, 1.0f,
                          2.5f, 6.0f,   100.0f, 1e5f,   2e9f,   4.3e9f, 9e9f,  1e10f, 1e20f, 1e38f})
    bias.push_back(magnitude), bias.push_back(-magnitude);
  bias.resize(48, 0.5f);
  const int64_t n = int64_t(bias.size()), k = 32;
  const std::vector<int8_t> zeros(static_cast<size_t>(n * k), 0);
  const std::vector<float> scale_w(static_cast<size_t>(n), 0.01f);
  const ops::DeviceInt8Weights weights(gpu, zeros.data(), scale_w, bias, n, k);
  for (int64_t rows : {37, 34000})  // one tile a block; ping-pong (more than two tiles an SM on an H100 or H200)
    for (float scale : {0x1p-24f, 0.004f, 3.0f, 0x1p24f}) {
      SCOPED_TRACE(std::to_string(rows) + " rows, scale " + std::to_string(scale));
      const std::vector<float> x = random_values(rows * k, 3);
      Graph<float> g(gpu);
      NoGradGuard<float> no_grad(g);
      const Var xv = g.input(std::span<const float>(x), Shape{rows, k});
      const ops::DeviceGeluTable made(gpu, scale);
      const ops::Int8OutputPart part{n, scale, &made};
      const std::vector<float> got = g.to_host(ops::int8_linear_quantized(
          g, xv, weights, 3.0f / 127, true, std::span<const ops::Int8OutputPart>(&part, 1), true)[0]);
      std::vector<float> stored;
      for (int64_t r = 0; r < rows; ++r)
        for (float b : bias) stored.push_back(bf16_representable(b));
      const Var sv = g.input(std::span<const float>(stored), Shape{rows, n});
      const Var sc = g.input(std::span<const float>(&scale, 1), Shape{1});
      const std::vector<float> want = g.to_host(ops::gelu(g, sv, ops::QuantizeOutput{sc}));
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_EQ(got[i], std::nearbyint(want[i] / scale)) << "output " << stored[i];
    }
}

// INT8 self-attention as int8_attention_integers documents it, on the host: exact integer products, the
// scores and probabilities rounded to BF16 where `bf16` (as the BF16 fake-quantized model stores them),
// softmax in float (std::exp), the context rounded as stored. Integers (B, T, H D) in q, k, v.
std::vector<float> int8_attention_reference(const std::array<std::vector<int8_t>, 3>& qkv,
                                            const std::vector<float>& mask, int64_t batch, int64_t t, int64_t heads,
                                            int64_t d, const ops::Int8AttentionScales& scales, double alpha,
                                            bool bf16) {
  auto stored = [bf16](float v) { return bf16 ? bf16_representable(v) : v; };
  const int64_t width = heads * d;
  const float score_scale = scales.q * static_cast<float>(scales.k * alpha), context_scale = scales.probs * scales.v;
  std::vector<float> y(static_cast<size_t>(batch * t * width)), s(static_cast<size_t>(t));
  std::vector<int> p(static_cast<size_t>(t));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < t; ++i) {
        const int8_t* q = qkv[0].data() + (b * t + i) * width + h * d;
        float max = -std::numeric_limits<float>::infinity(), sum = 0;
        for (int64_t j = 0; j < t; ++j) {
          const int8_t* k = qkv[1].data() + (b * t + j) * width + h * d;
          int dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += int(q[c]) * int(k[c]);
          s[j] = stored(float(dot) * score_scale) + mask[size_t(b * t + j)];
          max = std::max(max, s[j]);
        }
        for (int64_t j = 0; j < t; ++j) sum += s[j] = std::exp(s[j] - max);
        const float inverse = 1.0f / sum;
        for (int64_t j = 0; j < t; ++j)
          p[j] = int(std::clamp(std::nearbyint(stored(s[j] * inverse) / scales.probs), -128.0f, 127.0f));
        for (int64_t c = 0; c < d; ++c) {
          int dot = 0;
          for (int64_t j = 0; j < t; ++j) dot += p[j] * int(qkv[2][size_t((b * t + j) * width + h * d + c)]);
          y[size_t((b * t + i) * width + h * d + c)] = stored(float(dot) * context_scale);
        }
      }
  return y;
}

// INT8 self-attention on the GPU (int8_attention_integers: int8 tensor-core products of the integers of Q, K
// and V) against the CPU's integer attention (int8_attention, FP32) and the host reference above (FP32 and
// BF16). The products' sums are exact on every side; the softmax differs by expf against the host's exp and
// by summation order, and such a difference can move a probability across its quantizer's rounding boundary:
// one quantization step of one probability, at most sp * sv * 128 in a context value. So: at most 2 such
// steps in any value, and nearly every value equal (within 1e-6 of the largest). Against the fake-quantized
// ops on the GPU (head_scores, softmax with the probabilities' quantizer, head_context) on the same values:
// the same in FP32; in BF16 those multiply BF16 roundings of the quantized values (q * scale is not a BF16
// number), so scores a BF16 step apart and more probabilities a step apart (1.4% of the mean value, on
// average, here): the mean difference within 2.5% of the mean value. The fake-quantized model's products with exact
// sums (exact_quantized_attention: cuBLAS on the integers) as the CPU engine, in both precisions. The int8 output is
// the stored context quantized at the consumer's scale, bit for bit. Lengths of 1 to 512 (partial chunks of 32 keys and
// blocks of 64 queries), padded keys, head sizes 32, 64, 128.
TEST_F(CudaOps, Int8AttentionOnTheGpuEqualsTheCpuEngine) {
  struct Case {
    int64_t batch, t, heads, d;
  };
  for (const Case& c :
       {Case{3, 37, 2, 64}, Case{2, 128, 3, 32}, Case{1, 300, 2, 128}, Case{2, 512, 1, 64}, Case{2, 1, 2, 64}}) {
    const int64_t width = c.heads * c.d, n = c.batch * c.t * width;
    SCOPED_TRACE("B " + std::to_string(c.batch) + " T " + std::to_string(c.t) + " H " + std::to_string(c.heads) +
                 " D " + std::to_string(c.d));
    std::mt19937 gen(uint32_t(c.t * 7 + c.d));
    std::uniform_int_distribution<int> byte(-128, 127);
    std::array<std::vector<int8_t>, 3> integers;
    for (auto& v : integers) {
      v.resize(size_t(n));
      for (int8_t& x : v) x = static_cast<int8_t>(byte(gen));
    }
    // Scores spread over a few units (some probabilities near 1, most near 0), the probabilities' quantizer
    // at 1 / 127 as max calibration sets it.
    const ops::Int8AttentionScales scales{0.0231f, 0.0187f, 0.0313f, 1.0f / 127};
    const double alpha = 1.0 / std::sqrt(double(c.d));
    std::vector<float> mask(size_t(c.batch * c.t), 0.0f);
    for (int64_t b = 0; b < c.batch; ++b)  // sequence b: its last b * 3 keys padded (one key stays)
      for (int64_t j = std::max<int64_t>(1, c.t - 3 * b); j < c.t; ++j) mask[size_t(b * c.t + j)] = -10000.0f;
    std::array<std::vector<float>, 3> values;  // the fake-quantized model's Q, K, V
    const std::array<float, 3> operand_scales = {scales.q, scales.k, scales.v};
    for (int i = 0; i < 3; ++i) {
      values[i].resize(size_t(n));
      for (int64_t j = 0; j < n; ++j) values[i][j] = float(integers[i][j]) * operand_scales[i];
    }
    const Shape shape{c.batch, c.t, width};
    std::vector<float> cpu;
    {
      Graph<float> g(Device::cpu());
      NoGradGuard<float> no_grad(g);
      auto in = [&](const std::vector<float>& v) { return g.input(std::span<const float>(v), shape); };
      cpu = g.to_host(ops::int8_attention(g, in(values[0]), in(values[1]), in(values[2]),
                                          g.input(std::span<const float>(mask), Shape{c.batch, c.t}), c.heads, scales,
                                          alpha));
    }
    const float step = scales.probs * scales.v * 128;  // one probability's quantization step, at most
    for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
      const bool bf16 = gpu->precision() == Precision::kBf16;
      SCOPED_TRACE(bf16 ? "bf16" : "fp32");
      Graph<float> g(*gpu);
      NoGradGuard<float> no_grad(g);
      ASSERT_TRUE(ops::int8_attention_fits(g, c.d, c.t));
      std::array<Var, 3> qkv;
      for (int i = 0; i < 3; ++i) {
        qkv[i] = g.emit(shape, {}, DType::kS8);
        gpu->copy_to_device(g.data(qkv[i]), integers[i].data(), size_t(n));
      }
      const Var mv = g.input(std::span<const float>(mask), Shape{c.batch, c.t});
      const Var context = ops::int8_attention_integers(g, qkv[0], qkv[1], qkv[2], mv, c.heads, scales, alpha);
      EXPECT_EQ(g.dtype(context), g.activation_dtype());
      EXPECT_EQ(g.shape(context), shape);
      const std::vector<float> y = g.to_host(context);
      // The fake-quantized ops on the same values.
      auto in = [&](const std::vector<float>& v) { return g.input(std::span<const float>(v), shape); };
      const Var q = in(values[0]), k = in(values[1]), v = in(values[2]);
      const float probs_scale = scales.probs;
      const Var sp = g.input(std::span<const float>(&probs_scale, 1), Shape{1});
      Rng rng(1);
      const Var probs = ops::softmax_dropout(g, ops::head_scores(g, q, k, c.heads, alpha), mv, 0.0, false, rng,
                                             ops::QuantizeOutput{sp});
      const std::vector<float> fake = g.to_host(ops::head_context(g, probs, v, c.heads));
      const std::vector<float> exact =
          g.to_host(ops::exact_quantized_attention(g, q, k, v, mv, c.heads, scales, alpha, ops::QuantizeOutput{sp}));
      const std::vector<float> reference =
          int8_attention_reference(integers, mask, c.batch, c.t, c.heads, c.d, scales, alpha, bf16);
      using Reference = std::pair<const std::vector<float>*, const char*>;
      for (const auto& [expected, name] :
           {Reference{&cpu, "CPU engine"}, Reference{&reference, "host reference"},
            Reference{&exact, "exact_quantized_attention"}, Reference{&fake, "fake-quantized ops"}}) {
        if (bf16 && expected == &cpu) continue;  // (the CPU engine rounds nothing to BF16)
        double largest = 0, worst = 0, total = 0, magnitude = 0;
        int64_t apart = 0;
        for (int64_t j = 0; j < n; ++j) largest = std::max(largest, std::abs(double((*expected)[j])));
        for (int64_t j = 0; j < n; ++j) {
          const double diff = std::abs(double(y[j]) - (*expected)[j]);
          worst = std::max(worst, diff);
          total += diff, magnitude += std::abs(double((*expected)[j]));
          apart += diff > 1e-6 * largest;
        }
        std::cout << "[ info ] " << name << (bf16 ? " (bf16)" : "") << ": " << apart << " of " << n
                  << " context values apart, largest difference " << worst << " (a step: " << step
                  << "), mean difference " << total / double(n) << " (mean value " << magnitude / double(n) << ")\n";
        if (bf16 && expected == &fake) {
          EXPECT_LE(total, 2.5e-2 * magnitude) << name;
        } else {
          EXPECT_LE(worst, 2 * step) << name;
          EXPECT_LE(double(apart), 0.01 * double(n)) << name;
        }
      }
      // The context's integers at the output layer's scale: the stored context quantized.
      const float out_scale = 0.0117f;
      const Var quantized =
          ops::int8_attention_integers(g, qkv[0], qkv[1], qkv[2], mv, c.heads, scales, alpha, out_scale);
      EXPECT_EQ(g.dtype(quantized), DType::kS8);
      std::vector<float> want(y.size());
      for (size_t j = 0; j < y.size(); ++j) want[j] = std::clamp(std::nearbyint(y[j] / out_scale), -128.0f, 127.0f);
      EXPECT_EQ(g.to_host(quantized), want);
      {  // no mask: every key counts (at lengths a multiple of 32 the kernel that adds no mask)
        const std::vector<float> unmasked =
            g.to_host(ops::int8_attention_integers(g, qkv[0], qkv[1], qkv[2], Var{}, c.heads, scales, alpha));
        std::vector<float> zeros(mask.size(), 0.0f);
        const Var zero_mask = g.input(std::span<const float>(zeros), Shape{c.batch, c.t});
        EXPECT_EQ(unmasked, g.to_host(ops::int8_attention_integers(g, qkv[0], qkv[1], qkv[2], zero_mask, c.heads,
                                                                   scales, alpha)));
      }
    }
  }
  // What it covers, and bad input.
  Graph<float> g(*gpu_);
  NoGradGuard<float> no_grad(g);
  EXPECT_FALSE(ops::int8_attention_fits(g, 16, 128));
  EXPECT_FALSE(ops::int8_attention_fits(g, 64, 513));
  const Shape shape{1, 8, 64};
  const std::vector<float> x(64 * 8, 0.5f);
  const Var floats = g.input(std::span<const float>(x), shape);
  const Var s8 = g.emit(shape, {}, DType::kS8);
  const ops::Int8AttentionScales scales{0.1f, 0.1f, 0.1f, 1.0f / 127};
  EXPECT_THROW(ops::int8_attention_integers(g, floats, floats, floats, Var{}, 1, scales, 0.125), std::exception);
  EXPECT_THROW(ops::int8_attention_integers(g, s8, s8, s8, Var{}, 3, scales, 0.125), std::exception);  // 64 / 3
  EXPECT_THROW(ops::int8_attention_integers(g, s8, s8, s8, Var{}, 4, scales, 0.125), std::exception);  // head 16
  EXPECT_THROW(ops::int8_attention_integers(g, s8, s8, s8, Var{}, 1, {0.1f, 0.0f, 0.1f, 0.1f}, 0.125), std::exception);
  Graph<float> cpu_graph(Device::cpu());
  NoGradGuard<float> cpu_no_grad(cpu_graph);
  const Var on_cpu = cpu_graph.input(std::span<const float>(x), shape);
  EXPECT_THROW(ops::int8_attention_integers(cpu_graph, on_cpu, on_cpu, on_cpu, Var{}, 1, scales, 0.125),
               std::exception);
}

// LayerNorm writing its output only as its readers' quantizers read it (add_layer_norm_quantized, GPU
// integer inference) against the ops one by one: dropout_add_layer_norm (with the add's input quantizer or
// without), then fake_quantize of the stored output for each reader, bit for bit in FP32 and BF16; int8
// outputs are those values divided by their scale; scale 0 gives the output itself. Both fake-quantized runs
// the kernel that tests the outputs' kinds a chunk; integers with the output itself or with a fake-quantized
// one (at another scale or at the integers' own) run the kernels compiled for those. Rows of 768 and 100 columns; rows
// of 1,030 (past the row kernels) give nothing (the caller's ops run).
TEST_F(CudaOps, AddLayerNormQuantizedEqualsTheOpsOneByOne) {
  for (const int64_t c : {int64_t{768}, int64_t{100}}) {
    SCOPED_TRACE("columns " + std::to_string(c));
    const int64_t rows = 37;
    const std::vector<float> a = random_values(rows * c, 3), b = random_values(rows * c, 4);
    std::vector<float> gamma = random_values(c, 5), beta = random_values(c, 6);
    const float add_scale = 0.011f, first = 0.021f, second = 0.017f;
    for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
      SCOPED_TRACE(gpu->precision() == Precision::kBf16 ? "bf16" : "fp32");
      for (bool with_add_quantizer : {true, false}) {
        SCOPED_TRACE(with_add_quantizer ? "add input quantized" : "add input as it is");
        Graph<float> g(*gpu);
        NoGradGuard<float> no_grad(g);
        const Var av = g.input(std::span<const float>(a), Shape{rows, c});
        const Var bv = g.input(std::span<const float>(b), Shape{rows, c});
        const Var gv = g.input(std::span<const float>(gamma), Shape{c});
        const Var betav = g.input(std::span<const float>(beta), Shape{c});
        auto scale_of = [&](float s) { return g.input(std::span<const float>(&s, 1), Shape{1}); };
        const ops::QuantizeOutput q{scale_of(add_scale)};
        Rng rng(1);
        const Var y = with_add_quantizer ? ops::dropout_add_layer_norm(g, av, bv, gv, betav, 1e-12, 0.1, false, rng, q)
                                         : ops::dropout_add_layer_norm(g, av, bv, gv, betav, 1e-12, 0.1, false, rng);
        const std::vector<float> want_first = g.to_host(ops::fake_quantize(g, y, scale_of(first), -128, 127));
        const std::vector<float> want_second = g.to_host(ops::fake_quantize(g, y, scale_of(second), -128, 127));
        const std::array<ops::NormOutput, 2> fake = {ops::NormOutput{first, false}, ops::NormOutput{second, false}};
        const std::array<ops::NormOutput, 2> mixed = {ops::NormOutput{first, true}, ops::NormOutput{0.0f, false}};
        const ops::QuantizeOutput* add = with_add_quantizer ? &q : nullptr;
        const std::vector<Var> made = ops::add_layer_norm_quantized(g, av, bv, gv, betav, 1e-12, add, fake);
        ASSERT_EQ(made.size(), 2u);
        EXPECT_EQ(g.dtype(made[0]), g.activation_dtype());
        EXPECT_EQ(g.to_host(made[0]), want_first);
        EXPECT_EQ(g.to_host(made[1]), want_second);
        const std::vector<Var> integers = ops::add_layer_norm_quantized(g, av, bv, gv, betav, 1e-12, add, mixed);
        ASSERT_EQ(integers.size(), 2u);
        EXPECT_EQ(g.dtype(integers[0]), DType::kS8);
        std::vector<float> divided(want_first.size());
        for (size_t i = 0; i < divided.size(); ++i) divided[i] = std::nearbyint(want_first[i] / first);
        EXPECT_EQ(g.to_host(integers[0]), divided);
        EXPECT_EQ(g.to_host(integers[1]), g.to_host(y));
        // An INT8 model's residual LayerNorm: the integers and the fake-quantized values (compiled in).
        const std::array<ops::NormOutput, 2> integers_fake = {ops::NormOutput{first, true},
                                                              ops::NormOutput{second, false}};
        const std::vector<Var> both = ops::add_layer_norm_quantized(g, av, bv, gv, betav, 1e-12, add, integers_fake);
        ASSERT_EQ(both.size(), 2u);
        EXPECT_EQ(g.to_host(both[0]), divided);
        EXPECT_EQ(g.to_host(both[1]), want_second);
        // The same with both quantizers at one scale (the quotients worked out once on rows of 768).
        const std::array<ops::NormOutput, 2> shared_scale = {ops::NormOutput{first, true},
                                                             ops::NormOutput{first, false}};
        const std::vector<Var> once = ops::add_layer_norm_quantized(g, av, bv, gv, betav, 1e-12, add, shared_scale);
        ASSERT_EQ(once.size(), 2u);
        EXPECT_EQ(g.to_host(once[0]), divided);
        EXPECT_EQ(g.to_host(once[1]), want_first);
      }
    }
  }
  Graph<float> g(*gpu_);
  NoGradGuard<float> no_grad(g);
  const std::vector<float> wide = random_values(2 * 1030, 3), ones(1030, 1.0f);
  const Var x = g.input(std::span<const float>(wide), Shape{2, 1030});
  const Var gv = g.input(std::span<const float>(ones), Shape{1030});
  const std::array<ops::NormOutput, 1> one = {ops::NormOutput{0.02f, true}};
  EXPECT_TRUE(ops::add_layer_norm_quantized(g, x, x, gv, gv, 1e-12, nullptr, one).empty());
  const std::array<ops::NormOutput, 1> unquantized_integers = {ops::NormOutput{0.0f, true}};
  EXPECT_THROW(ops::add_layer_norm_quantized(g, x, x, gv, gv, 1e-12, nullptr, unquantized_integers), std::exception);
}

// BERT's embeddings and their LayerNorm in one kernel (embedding_layer_norm_quantized, GPU inference) against
// the ops one by one: gather_rows of the word, position and token-type rows, the two adds, then LayerNorm
// (the output itself) or add_layer_norm_quantized's outputs (one output of integers, two, integers with a
// fake-quantized output or with the value), bit for bit in FP32 and BF16, for (B, T) and (T) ids, on rows of
// 768 and 256. Rows of 100 columns (not a multiple of 128) give nothing; bad ids and shapes are refused.
TEST_F(CudaOps, EmbeddingLayerNormQuantizedEqualsTheOpsOneByOne) {
  for (const int64_t c : {int64_t{768}, int64_t{256}}) {
    SCOPED_TRACE("columns " + std::to_string(c));
    const int64_t vocab = 53, max_positions = 16, batch = 3, t = 11;
    const std::vector<float> words = random_values(vocab * c, 3), positions = random_values(max_positions * c, 4),
                             types = random_values(2 * c, 5);
    const std::vector<float> gamma = random_values(c, 6), beta = random_values(c, 7);
    std::vector<int32_t> ids(batch * t), type_ids(batch * t), position_ids(t);
    Rng draws(9);
    for (int64_t i = 0; i < batch * t; ++i)
      ids[i] = static_cast<int32_t>(draws.next_below(vocab)), type_ids[i] = static_cast<int32_t>(i % t >= 5);
    ids[0] = 0, ids[1] = static_cast<int32_t>(vocab - 1);
    std::iota(position_ids.begin(), position_ids.end(), 0);
    const float first = 0.021f, second = 0.017f;
    for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
      SCOPED_TRACE(gpu->precision() == Precision::kBf16 ? "bf16" : "fp32");
      Graph<float> g(*gpu);
      NoGradGuard<float> no_grad(g);
      const Var wv = g.input(std::span<const float>(words), Shape{vocab, c});
      const Var pv = g.input(std::span<const float>(positions), Shape{max_positions, c});
      const Var tv = g.input(std::span<const float>(types), Shape{2, c});
      const Var gv = g.input(std::span<const float>(gamma), Shape{c});
      const Var betav = g.input(std::span<const float>(beta), Shape{c});
      for (const Shape ids_shape : {Shape{batch, t}, Shape{t}}) {
        SCOPED_TRACE("ids " + ids_shape.str());
        const std::span<const int32_t> id_span(ids.data(), size_t(ids_shape.numel()));
        const std::span<const int32_t> type_span(type_ids.data(), size_t(ids_shape.numel()));
        const Var sum = ops::add(g, ops::gather_rows(g, wv, id_span, ids_shape),
                                 ops::gather_rows(g, pv, position_ids, Shape{t}));
        const Var type = ops::gather_rows(g, tv, type_span, ids_shape);
        const Var y = ops::layer_norm(g, ops::add(g, sum, type), gv, betav, 1e-12);
        const std::vector<Var> plain =
            ops::embedding_layer_norm_quantized(g, wv, pv, tv, id_span, type_span, ids_shape, gv, betav, 1e-12, {});
        ASSERT_EQ(plain.size(), 1u);
        EXPECT_EQ(g.shape(plain[0]), g.shape(y));
        EXPECT_EQ(g.dtype(plain[0]), g.activation_dtype());
        EXPECT_EQ(g.to_host(plain[0]), g.to_host(y));
        using Outs = std::vector<ops::NormOutput>;
        for (const Outs& outs : {Outs{{first, true}}, Outs{{first, true}, {second, true}},
                                 Outs{{first, true}, {second, false}}, Outs{{first, true}, {0.0f, false}}}) {
          SCOPED_TRACE("outputs " + std::to_string(outs.size()) + ", the last " +
                       (outs.back().integers    ? "integers"
                        : outs.back().scale > 0 ? "fake-quantized"
                                                : "the value"));
          const std::vector<Var> want = ops::add_layer_norm_quantized(g, sum, type, gv, betav, 1e-12, nullptr, outs);
          const std::vector<Var> made =
              ops::embedding_layer_norm_quantized(g, wv, pv, tv, id_span, type_span, ids_shape, gv, betav, 1e-12, outs);
          ASSERT_EQ(made.size(), outs.size());
          ASSERT_EQ(want.size(), outs.size());
          for (size_t o = 0; o < outs.size(); ++o) {
            EXPECT_EQ(g.dtype(made[o]), g.dtype(want[o]));
            EXPECT_EQ(g.to_host(made[o]), g.to_host(want[o]));
          }
        }
      }
      // Refused: an id outside the table, a token type outside its table, more positions than the table has,
      // ids that do not match their shape.
      std::vector<int32_t> bad = ids;
      bad[4] = static_cast<int32_t>(vocab);
      EXPECT_THROW(ops::embedding_layer_norm_quantized(g, wv, pv, tv, bad, type_ids, Shape{batch, t}, gv, betav, 1e-12, {}),
                   std::exception);
      EXPECT_THROW(ops::embedding_layer_norm_quantized(g, wv, pv, tv, ids, bad, Shape{batch, t}, gv, betav, 1e-12, {}),
                   std::exception);
      const std::vector<int32_t> long_ids(2 * (max_positions + 1), 1);
      EXPECT_THROW(ops::embedding_layer_norm_quantized(g, wv, pv, tv, long_ids, long_ids, Shape{2, max_positions + 1},
                                                       gv, betav, 1e-12, {}),
                   std::exception);
      EXPECT_THROW(ops::embedding_layer_norm_quantized(g, wv, pv, tv, ids, type_ids, Shape{batch, t + 1}, gv, betav,
                                                       1e-12, {}),
                   std::exception);
    }
  }
  Graph<float> g(*gpu_);
  NoGradGuard<float> no_grad(g);
  const std::vector<float> narrow = random_values(4 * 100, 3), ones(100, 1.0f);
  const Var table = g.input(std::span<const float>(narrow), Shape{4, 100});
  const Var gv = g.input(std::span<const float>(ones), Shape{100});
  const std::vector<int32_t> ids = {0, 1, 2};
  EXPECT_TRUE(
      ops::embedding_layer_norm_quantized(g, table, table, table, ids, ids, Shape{3}, gv, gv, 1e-12, {}).empty());
}

// Integer addends (an INT8 model's residual stream, ops::NormInputs): a and b given as int8 integers at their
// scales give, bit for bit in FP32 and BF16, what those integers' values (i * scale, as their quantizers'
// fake quantization stores them) give in the activations' dtype: one output of integers and two (on rows of
// 768 the kernels compiled for both addends as integers), integers with a fake-quantized output, the output
// itself, and a or b alone as integers (the kernel that tests the addends' kinds a row); rows of 100 columns
// (that kernel for every kind). Mismatched dtypes and scales, an add-input quantizer on integers and rows
// past the row kernels are refused.
TEST_F(CudaOps, AddLayerNormQuantizedReadsIntegerAddends) {
  for (const int64_t c : {int64_t{768}, int64_t{100}}) {
    SCOPED_TRACE("columns " + std::to_string(c));
    const int64_t rows = 37, n = rows * c;
    const float a_scale = 0.013f, b_scale = 0.029f, first = 0.021f, second = 0.017f;
    std::vector<int8_t> ia(n), ib(n);
    Rng draws(7);
    for (int64_t i = 0; i < n; ++i) {
      ia[i] = static_cast<int8_t>(static_cast<int>(draws.next_below(256)) - 128);
      ib[i] = static_cast<int8_t>(static_cast<int>(draws.next_below(256)) - 128);
    }
    ia[0] = -128, ia[1] = 127, ib[2] = -128, ib[3] = 127;
    std::vector<float> va(n), vb(n);
    for (int64_t i = 0; i < n; ++i) va[i] = float(ia[i]) * a_scale, vb[i] = float(ib[i]) * b_scale;
    const std::vector<float> gamma = random_values(c, 5), beta = random_values(c, 6);
    for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
      SCOPED_TRACE(gpu->precision() == Precision::kBf16 ? "bf16" : "fp32");
      Graph<float> g(*gpu);
      NoGradGuard<float> no_grad(g);
      ASSERT_TRUE(ops::add_layer_norm_reads_integers(g, c));
      const Var av = g.input(std::span<const float>(va), Shape{rows, c});
      const Var bv = g.input(std::span<const float>(vb), Shape{rows, c});
      auto integers = [&](const std::vector<int8_t>& v) {
        const Var x = g.emit(Shape{rows, c}, {}, DType::kS8);
        gpu->copy_to_device(g.data(x), v.data(), size_t(n));
        return x;
      };
      const Var a8 = integers(ia), b8 = integers(ib);
      const Var gv = g.input(std::span<const float>(gamma), Shape{c});
      const Var betav = g.input(std::span<const float>(beta), Shape{c});
      using Outs = std::vector<ops::NormOutput>;
      const std::vector<Outs> kinds = {
          {{first, true}}, {{first, true}, {second, true}}, {{first, true}, {second, false}}, {{0.0f, false}}};
      for (const Outs& outs : kinds) {
        SCOPED_TRACE("outputs " + std::to_string(outs.size()) + ", the last " +
                     (outs.back().integers    ? "integers"
                      : outs.back().scale > 0 ? "fake-quantized"
                                              : "the value"));
        const std::vector<Var> want = ops::add_layer_norm_quantized(g, av, bv, gv, betav, 1e-12, nullptr, outs);
        ASSERT_EQ(want.size(), outs.size());
        for (const auto& [a, b, in] :
             {std::tuple{a8, b8, ops::NormInputs{a_scale, b_scale}}, std::tuple{a8, bv, ops::NormInputs{a_scale, 0.0f}},
              std::tuple{av, b8, ops::NormInputs{0.0f, b_scale}}}) {
          SCOPED_TRACE(std::string(in.a_scale > 0 ? "a" : "") + (in.b_scale > 0 ? "b" : "") + " as integers");
          const std::vector<Var> made = ops::add_layer_norm_quantized(g, a, b, gv, betav, 1e-12, nullptr, outs, in);
          ASSERT_EQ(made.size(), outs.size());
          for (size_t o = 0; o < outs.size(); ++o) {
            EXPECT_EQ(g.dtype(made[o]), g.dtype(want[o]));
            EXPECT_EQ(g.to_host(made[o]), g.to_host(want[o]));
          }
        }
      }
      // Refused: integers without a scale or a scale on values, an add-input quantizer on integers.
      const std::array<ops::NormOutput, 1> one = {ops::NormOutput{first, true}};
      EXPECT_THROW(ops::add_layer_norm_quantized(g, a8, bv, gv, betav, 1e-12, nullptr, one), std::exception);
      EXPECT_THROW(ops::add_layer_norm_quantized(g, av, bv, gv, betav, 1e-12, nullptr, one, {a_scale, 0.0f}),
                   std::exception);
      EXPECT_THROW(ops::add_layer_norm_quantized(g, av, b8, gv, betav, 1e-12, nullptr, one, {0.0f, -1.0f}),
                   std::exception);
      const float add_scale = 0.011f;
      const ops::QuantizeOutput q{g.input(std::span<const float>(&add_scale, 1), Shape{1})};
      EXPECT_THROW(ops::add_layer_norm_quantized(g, a8, b8, gv, betav, 1e-12, &q, one, {a_scale, b_scale}),
                   std::exception);
    }
  }
  Graph<float> g(*gpu_);
  NoGradGuard<float> no_grad(g);
  EXPECT_FALSE(ops::add_layer_norm_reads_integers(g, 1030));
  EXPECT_FALSE(ops::add_layer_norm_reads_integers(g, 102));
  const Var wide = g.emit(Shape{2, 1032}, {}, DType::kS8);
  g.device().fill_zero(g.data(wide), 2 * 1032);
  const std::vector<float> ones(1032, 1.0f);
  const Var gv = g.input(std::span<const float>(ones), Shape{1032});
  const std::array<ops::NormOutput, 1> one = {ops::NormOutput{0.02f, true}};
  EXPECT_THROW(ops::add_layer_norm_quantized(g, wide, wide, gv, gv, 1e-12, nullptr, one, {0.1f, 0.1f}), std::exception);
  Graph<float> cpu_graph(Device::cpu());
  EXPECT_FALSE(ops::add_layer_norm_reads_integers(cpu_graph, 768));
}

TEST_F(CudaOps, AddMulScaleOnBf16Activations) {
  const std::vector<std::pair<Shape, Shape>> cases = {{{4, 6, 8}, {4, 6, 8}}, {{4, 6, 8}, {8}}, {{4, 1, 8}, {4, 6, 1}}};
  for (const auto& [a, b] : cases) {
    SCOPED_TRACE(a.str() + " " + b.str());
    compare(
        {a, b},
        [](Graph<float>& g, const std::vector<Var>& in) {
          return ops::add(g, ops::gelu(g, in[0]), ops::gelu(g, in[1]));
        },
        kElementwise, kElementwise);
    compare(
        {a, b},
        [](Graph<float>& g, const std::vector<Var>& in) {
          return ops::mul(g, ops::gelu(g, in[0]), ops::gelu(g, in[1]));
        },
        kElementwise, kReduction);
  }
  compare(
      {Shape{3, 7}},
      [](Graph<float>& g, const std::vector<Var>& in) { return ops::scale(g, ops::gelu(g, in[0]), -0.37); },
      kElementwise, kElementwise);
}

// Which dtype each node takes in BF16 mixed precision (ops/cuda_impl.h), and that parameter gradients stay F32.
TEST_F(CudaOps, Bf16ModeStoresActivationsInBf16AndKeepsParametersAndLossesInF32) {
  Graph<float> g(*gpu_bf16_);
  EXPECT_EQ(g.activation_dtype(), DType::kBF16);
  EXPECT_EQ(Graph<float>(*gpu_).activation_dtype(), DType::kF32);
  const std::vector<float> xs = random_values(4 * 6, 1), ws = random_values(5 * 6, 2), bs = random_values(5, 3),
                           zs = random_values(4 * 5, 4);
  DeviceBuffer w(*gpu_bf16_, ws.size() * 4), dw(*gpu_bf16_, ws.size() * 4), b(*gpu_bf16_, bs.size() * 4),
      db(*gpu_bf16_, bs.size() * 4);
  gpu_bf16_->copy_to_device(w.data(), ws.data(), ws.size() * 4);
  gpu_bf16_->copy_to_device(b.data(), bs.data(), bs.size() * 4);
  gpu_bf16_->fill_zero(dw.data(), dw.bytes());
  gpu_bf16_->fill_zero(db.data(), db.bytes());
  Var x = g.input(std::span<const float>(xs), Shape{4, 6});
  Var wv = g.leaf(TensorView<float>(w.as<float>(), Shape{5, 6}), TensorView<float>(dw.as<float>(), Shape{5, 6}));
  Var bv = g.leaf(TensorView<float>(b.as<float>(), Shape{5}), TensorView<float>(db.as<float>(), Shape{5}));
  EXPECT_EQ(g.dtype(x), DType::kF32);
  Var y = ops::linear(g, x, wv, bv);
  EXPECT_EQ(g.dtype(y), DType::kBF16);
  EXPECT_THROW(g.value(y), InternalError);  // its storage holds 2-byte elements
  EXPECT_EQ(g.dtype(ops::gelu(g, y)), DType::kBF16);
  EXPECT_EQ(g.dtype(ops::add(g, y, y)), DType::kBF16);
  EXPECT_EQ(g.dtype(ops::add(g, y, g.input(std::span<const float>(zs), Shape{4, 5}))), DType::kF32);  // promoted
  const std::vector<int32_t> targets = {1, 0, 4, -1};
  Var loss = ops::cross_entropy<float>(g, y, targets);
  EXPECT_EQ(g.dtype(loss), DType::kF32);
  // The BF16 output, read on the host, is the FP32 product rounded to 8 mantissa bits.
  const std::vector<float> got = g.to_host(y);
  for (int r = 0; r < 4; ++r)
    for (int o = 0; o < 5; ++o) {
      double expect = bs[o];
      for (int i = 0; i < 6; ++i) expect += double(xs[r * 6 + i]) * ws[o * 6 + i];
      EXPECT_NEAR(got[r * 5 + o], expect, 1e-2 * (std::abs(expect) + 1)) << r << "," << o;
    }
  g.backward(loss);
  std::vector<float> grad(ws.size());
  gpu_bf16_->copy_to_host(grad.data(), dw.data(), dw.bytes());
  EXPECT_TRUE(std::any_of(grad.begin(), grad.end(), [](float v) { return v != 0; }));
}

// Calibration statistics: counted on the GPU exactly as on the CPU, for FP32 values and for BF16
// activations (against the CPU's count of the same values widened).
TEST_F(CudaOps, AbsMaxAndHistogramCountExactlyLikeTheCpu) {
  std::vector<float> v = random_values(3 * 100003, 9, 3.0f);
  v[17] = 0.0f;
  v[99] = -11.5f;
  for (const Device* gpu : {gpu_.get(), gpu_bf16_.get()}) {
    Graph<float> g(*gpu);
    Var x = g.input(std::span<const float>(v), Shape{3, 100003});
    if (gpu->precision() == Precision::kBf16) x = ops::permute(g, x, {0, 1});  // a BF16 copy
    std::vector<float> on_host = g.to_host(x);
    Graph<float> cpu;
    Var xc = cpu.constant(TensorView<float>(on_host.data(), Shape{3, 100003}));
    EXPECT_EQ(ops::abs_max(g, x), ops::abs_max(cpu, xc));
    for (double range : {11.5, 4.0, 0.37})
      EXPECT_EQ(ops::abs_histogram(g, x, range, 2048), ops::abs_histogram(cpu, xc, range, 2048)) << range;
  }
  v[5] = std::numeric_limits<float>::infinity();
  Graph<float> g(*gpu_);
  EXPECT_EQ(ops::abs_max(g, g.input(std::span<const float>(v), Shape{3, 100003})),
            std::numeric_limits<double>::infinity());
}

TEST_F(CudaOps, RowArgmaxOfBf16Activations) {
  std::vector<float> v = random_values(5 * 1000, 6);
  v[1 * 1000 + 3] = v[1 * 1000 + 700] = 100.0f;  // exact in BF16: a tie, the first wins
  v[4 * 1000 + 999] = 50.0f;
  Graph<float> g(*gpu_bf16_);
  Var x = ops::permute(g, g.input(std::span<const float>(v), Shape{5, 1000}), {0, 1});  // a BF16 copy
  ASSERT_EQ(g.dtype(x), DType::kBF16);
  const std::vector<int32_t> got = ops::row_argmax(g, x);
  EXPECT_EQ(got[1], 3);
  EXPECT_EQ(got[4], 999);
}

TEST_F(CudaOps, RowArgmaxFirstOnTies) {
  std::vector<float> v = random_values(9 * 30522, 5);
  v[2 * 30522 + 7] = v[2 * 30522 + 900] = 100.0f;  // a tie: the first wins
  Graph<float> cpu, gpu(*gpu_);
  DeviceBuffer d(*gpu_, v.size() * 4);
  gpu_->copy_to_device(d.data(), v.data(), v.size() * 4);
  const std::vector<int32_t> expected =
      ops::row_argmax(cpu, cpu.constant(TensorView<float>(v.data(), Shape{9, 30522})));
  EXPECT_EQ(ops::row_argmax(gpu, gpu.constant(TensorView<float>(d.as<float>(), Shape{9, 30522}))), expected);
  EXPECT_EQ(expected[2], 7);
}

TEST_F(CudaOps, TheDeviceNamesItselfAndReportsMemory) {
  EXPECT_NE(gpu_->name().find("cuda:0"), std::string::npos);
  const auto [used, total] = gpu_->memory_use();
  EXPECT_GT(total, used);
  EXPECT_GT(used, 0u);
}

}  // namespace
}  // namespace bert
