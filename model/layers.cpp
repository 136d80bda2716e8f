#include "model/layers.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/ops.h"
#include "sys/error.h"

namespace bert::model {

namespace {
int64_t scale_count(WeightScales weight_scales, int64_t out) {
  return weight_scales == WeightScales::kPerTensor ? 1 : out;
}
}  // namespace

Linear Linear::declare(ParameterArena<float>& params, const std::string& name, int64_t in, int64_t out,
                       bool quantizable, WeightScales weight_scales) {
  Linear l;
  l.name = name;
  l.in = in;
  l.out = out;
  l.weight = params.add(name + ".weight", {out, in});
  l.bias = params.add(name + ".bias", {out});
  l.quantizable = quantizable;
  if (quantizable) {
    l.input_quantizer = Quantizer::activation(params, name + ".input_quantizer");
    l.weight_quantizer = Quantizer::weight(params, name + ".weight_quantizer", scale_count(weight_scales, out));
  }
  return l;
}

std::array<Linear, 3> Linear::declare_side_by_side(ParameterArena<float>& params,
                                                   const std::array<std::string, 3>& names, int64_t in, int64_t out,
                                                   WeightScales weight_scales) {
  std::array<Linear, 3> layers;
  for (size_t i = 0; i < layers.size(); ++i) {
    Linear& l = layers[i];
    l.name = names[i], l.in = in, l.out = out, l.quantizable = true;
    l.weight = params.add(names[i] + ".weight", {out, in});
  }
  for (size_t i = 0; i < layers.size(); ++i) layers[i].bias = params.add(names[i] + ".bias", {out});
  for (size_t i = 0; i < layers.size(); ++i)
    layers[i].weight_quantizer =
        Quantizer::weight(params, names[i] + ".weight_quantizer", scale_count(weight_scales, out));
  return layers;
}

Var Linear::forward(Graph<float>& g, ParameterArena<float>& params, Var x) {
  // An int8 x holds the integers of this layer's input quantizer already (ops::int8_linear_quantized).
  if (quantizable && quantizes_input(g) && g.dtype(x) != DType::kS8) x = input().apply(g, params, x);
  return forward_quantized_input(g, params, x);
}

Var Linear::forward_quantized_input(Graph<float>& g, ParameterArena<float>& params, Var x, Var quantized_weight) {
  // x is already fake-quantized: the integer path quantizes it again to the same integers.
  if (runs_integer(g)) return integer_forward(g, params, x);
  const Var w = product_weight(g, params, quantized_weight);
  if (sums_exactly(g, params))
    return ops::exact_quantized_linear(g, x, params.get(input().scale).value.data()[0], w, weight_scales(params),
                                       g.param(params.get(bias)));
  if (trains_on_integers(g, params))
    return ops::quantized_linear(g, x, w, g.param(params.get(bias)), g.param(params.get(input().scale)),
                                 g.param(params.get(weight_quantizer.scale)));
  return ops::linear(g, x, w, g.param(params.get(bias)));
}

Var Linear::forward_gelu(Graph<float>& g, ParameterArena<float>& params, Var x) {
  if (quantizable && quantizes_input(g)) x = input().apply(g, params, x);
  return forward_gelu_quantized_input(g, params, x);
}

Var Linear::forward_gelu_quantized_input(Graph<float>& g, ParameterArena<float>& params, Var x, Var quantized_weight) {
  if (runs_integer(g)) return integer_forward(g, params, x, /*gelu=*/true);
  const Var w = product_weight(g, params, quantized_weight);
  if (sums_exactly(g, params))
    return ops::exact_quantized_linear(g, x, params.get(input().scale).value.data()[0], w, weight_scales(params),
                                       g.param(params.get(bias)), /*gelu=*/true);
  return ops::linear_gelu(g, x, w, g.param(params.get(bias)));
}

Var Linear::product_weight(Graph<float>& g, ParameterArena<float>& params, Var quantized_weight) {
  if (quantized_weight.valid()) return quantized_weight;
  const Var w = g.param(params.get(weight));
  return quantizable ? weight_quantizer.apply(g, params, w) : w;
}

std::vector<Var> Linear::quantize_weights(Graph<float>& g, ParameterArena<float>& params,
                                          std::span<Linear* const> layers) {
  for (const Linear* l : layers)
    if (!l->quantizable || l->weight_quantizer.mode != QuantMode::kQuantize || l->runs_integer(g)) return {};
  std::vector<ops::QuantizeInput> inputs;
  for (Linear* l : layers) {
    const Var w = g.param(params.get(l->weight));
    inputs.push_back({w, l->weight_quantizer.weight_output(g, params, g.shape(w))});
    inputs.back().q.integers = l->trains_on_integers(g, params);  // for ops::quantized_linear
  }
  return ops::fake_quantize_many(g, std::span<const ops::QuantizeInput>(inputs));
}

bool Linear::prepare_integer(ParameterArena<float>& params) {
  integer_weights.reset();
  if (!quantizable || input().mode != QuantMode::kQuantize || weight_quantizer.mode != QuantMode::kQuantize)
    return false;
  const std::vector<int8_t> q = quantized_weight(params);
  integer_weights = std::make_shared<const Int8Weights>(q.data(), out, in);
  if (params.on_cuda()) {
    const std::vector<float> scales = weight_scales(params);
    const TensorView<float> b = params.get(bias).value;
    device_integer_weights = std::make_shared<const ops::DeviceInt8Weights>(
        params.device(), q.data(), scales, std::span<const float>(b.data(), b.numel()), out, in);
  }
  return true;
}

std::vector<float> Linear::weight_scales(ParameterArena<float>& params) const {
  const TensorView<float> s = params.get(weight_quantizer.scale).value;
  if (s.numel() == out) return std::vector<float>(s.begin(), s.end());
  BERT_CHECK(s.numel() == 1, "'" + weight_quantizer.name + "' has " + std::to_string(s.numel()) + " scales for " +
                                 std::to_string(out) + " channels");
  return std::vector<float>(out, s[0]);
}

std::vector<int8_t> Linear::quantized_weight(ParameterArena<float>& params) const {
  const float* w = params.get(weight).value.data();
  const std::vector<float> scales = weight_scales(params);
  std::vector<int8_t> q(out * in);
  for (int64_t c = 0; c < out; ++c)
    for (int64_t i = 0; i < in; ++i) {
      // As fake quantization rounds: divide, round half to even, clamp to the weight range.
      const float v = std::nearbyint(w[c * in + i] / scales[c]);
      q[c * in + i] = static_cast<int8_t>(std::clamp(v, float(weight_quantizer.qmin), float(weight_quantizer.qmax)));
    }
  return q;
}

bool Linear::sums_exactly(const Graph<float>& g, ParameterArena<float>& params) const {
  const Quantizer& in = input();
  return quantizable && exact_sums && !g.grad_enabled() && in.mode == QuantMode::kQuantize &&
         weight_quantizer.mode == QuantMode::kQuantize && in.qmin >= -128 && in.qmax <= 127 &&
         weight_quantizer.qmin >= -128 && weight_quantizer.qmax <= 127 && params.get(in.scale).value.numel() == 1;
}

bool Linear::trains_on_integers(const Graph<float>& g, ParameterArena<float>& params) const {
  const Quantizer& in = input();
  return quantizable && integer_training && g.on_cuda() && g.grad_enabled() && in.mode == QuantMode::kQuantize &&
         weight_quantizer.mode == QuantMode::kQuantize && in.qmin >= -128 && in.qmax <= 127 &&
         weight_quantizer.qmin >= -128 && weight_quantizer.qmax <= 127 && params.get(in.scale).value.numel() == 1 &&
         params.get(weight_quantizer.scale).value.numel() == out;
}

bool Linear::runs_integer(const Graph<float>& g) const {
  return (g.on_cuda() ? device_integer_weights != nullptr : integer_weights != nullptr) && !g.grad_enabled() &&
         input().mode == QuantMode::kQuantize && weight_quantizer.mode == QuantMode::kQuantize;
}

float Linear::input_scale(ParameterArena<float>& params) const { return params.get(input().scale).value.data()[0]; }

Var Linear::integer_forward(Graph<float>& g, ParameterArena<float>& params, Var x, bool gelu) const {
  const float scale_x = input_scale(params);
  if (g.on_cuda()) return ops::int8_linear(g, x, *device_integer_weights, scale_x, gelu);
  const std::vector<float> scale_w = weight_scales(params);
  if (gelu) return ops::int8_linear_gelu(g, x, *integer_weights, scale_x, scale_w, g.param(params.get(bias)));
  return ops::int8_linear(g, x, *integer_weights, scale_x, scale_w, g.param(params.get(bias)));
}

LayerNorm LayerNorm::declare(ParameterArena<float>& params, const std::string& name, int64_t size, double eps) {
  LayerNorm n;
  n.name = name;
  n.eps = eps;
  n.gamma = params.add(name + ".weight", {size});
  n.beta = params.add(name + ".bias", {size});
  return n;
}

Var LayerNorm::forward(Graph<float>& g, ParameterArena<float>& params, Var x) const {
  return ops::layer_norm(g, x, g.param(params.get(gamma)), g.param(params.get(beta)), eps);
}

Var LayerNorm::forward_sum(Graph<float>& g, ParameterArena<float>& params, Var a, Var b) const {
  return ops::add_layer_norm(g, a, b, g.param(params.get(gamma)), g.param(params.get(beta)), eps);
}

Var LayerNorm::forward_dropout_sum(Graph<float>& g, ParameterArena<float>& params, Var a, Var b, double p,
                                   bool training, Rng& rng) const {
  return ops::dropout_add_layer_norm(g, a, b, g.param(params.get(gamma)), g.param(params.get(beta)), eps, p, training,
                                     rng);
}

Var LayerNorm::forward_dropout_sum(Graph<float>& g, ParameterArena<float>& params, Var a, Var b, double p,
                                   bool training, Rng& rng, const ops::QuantizeOutput& q) const {
  return ops::dropout_add_layer_norm(g, a, b, g.param(params.get(gamma)), g.param(params.get(beta)), eps, p, training,
                                     rng, q);
}

}  // namespace bert::model
