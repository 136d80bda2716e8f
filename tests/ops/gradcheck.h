// Central finite-difference gradient checking in double precision, and helpers shared by core tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "core/graph.h"
#include "core/rng.h"
#include "ops/ops.h"

namespace bert::testing {

inline Tensor<double> random_tensor(Shape shape, uint64_t seed, double scale = 1.0) {
  Tensor<double> t(shape);
  Rng rng(seed);
  for (int64_t i = 0; i < t.numel(); ++i) t[i] = scale * rng.next_normal();
  return t;
}

inline Tensor<float> to_float(const Tensor<double>& t) {
  Tensor<float> f(t.shape());
  for (int64_t i = 0; i < t.numel(); ++i) f[i] = static_cast<float>(t[i]);
  return f;
}

// Builds the op under test from leaf inputs and returns its output.
using BuildFn = std::function<Var(Graph<double>&, const std::vector<Var>&)>;

struct GradCheckOptions {
  double step = 1e-6;  // central-difference step h
  double abs_tolerance = 1e-7;
  double rel_tolerance = 1e-6;
  int max_elements_per_input = 64;   // larger inputs are checked at a random subset of elements
  std::vector<bool> differentiable;  // per input; empty = all
};

// Compares the graph's gradient of L = sum(R * out) (R a fixed random tensor) with respect to each
// differentiable input against (L(x + h) - L(x - h)) / 2h, element by element.
inline void expect_gradients_match(std::vector<Tensor<double>>& inputs, const BuildFn& build,
                                   GradCheckOptions options = {}) {
  const size_t n_inputs = inputs.size();
  auto is_diff = [&](size_t i) { return options.differentiable.empty() || options.differentiable[i]; };

  Graph<double> g;
  auto forward_loss = [&](const Tensor<double>& projection) {
    NoGradGuard<double> no_grad(g);
    std::vector<Var> leaves;
    for (auto& t : inputs) leaves.push_back(g.constant(t.view()));
    TensorView<double> out = g.value(build(g, leaves));
    double loss = 0;
    for (int64_t i = 0; i < out.numel(); ++i) loss += projection[i] * out[i];
    g.clear();
    return loss;
  };

  // Output shape, then the projection R.
  Shape out_shape;
  {
    NoGradGuard<double> no_grad(g);
    std::vector<Var> leaves;
    for (auto& t : inputs) leaves.push_back(g.constant(t.view()));
    out_shape = g.shape(build(g, leaves));
    g.clear();
  }
  Tensor<double> projection = random_tensor(out_shape, 991);

  // Analytic gradients, on a workspace filled with NaN first: an op whose backward reads a fresh
  // gradient buffer it should only write (Graph::grad_target) then gets NaN, not the zeros new memory
  // tends to hold.
  {
    constexpr int64_t kPoisoned = int64_t{1} << 20;
    double* poison = g.scratch<double>(kPoisoned);
    std::fill(poison, poison + kPoisoned, std::numeric_limits<double>::quiet_NaN());
    g.clear();
  }
  std::vector<Tensor<double>> grads;
  for (auto& t : inputs) grads.emplace_back(t.shape());
  std::vector<Var> leaves;
  for (size_t i = 0; i < n_inputs; ++i)
    leaves.push_back(is_diff(i) ? g.leaf(inputs[i].view(), grads[i].view()) : g.constant(inputs[i].view()));
  Var out = build(g, leaves);
  ASSERT_EQ(g.shape(out), out_shape);
  Var loss = ops::sum(g, ops::mul(g, out, g.constant(projection.view())));
  g.backward(loss);

  Rng pick(12345);
  for (size_t i = 0; i < n_inputs; ++i) {
    if (!is_diff(i)) continue;
    const int64_t n = inputs[i].numel();
    std::vector<int64_t> elements;
    if (n <= options.max_elements_per_input) {
      for (int64_t e = 0; e < n; ++e) elements.push_back(e);
    } else {
      for (int k = 0; k < options.max_elements_per_input; ++k) elements.push_back(pick.next_below(n));
    }
    for (int64_t e : elements) {
      const double saved = inputs[i][e];
      inputs[i][e] = saved + options.step;
      const double plus = forward_loss(projection);
      inputs[i][e] = saved - options.step;
      const double minus = forward_loss(projection);
      inputs[i][e] = saved;
      const double numeric = (plus - minus) / (2 * options.step);
      const double analytic = grads[i][e];
      const double tolerance =
          options.abs_tolerance + options.rel_tolerance * std::max(std::abs(numeric), std::abs(analytic));
      EXPECT_NEAR(analytic, numeric, tolerance)
          << "input " << i << " element " << e << " of " << inputs[i].shape().str();
    }
  }
}

}  // namespace bert::testing
