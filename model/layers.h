// The model's parametrised building blocks, each declaring its parameters in the arena under Hugging
// Face state-dict names and applying core ops in forward().
#pragma once

#include <array>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/graph.h"
#include "kernels/int8_gemm.h"
#include "model/config.h"
#include "model/quantizer.h"

namespace bert::ops {
class DeviceInt8Weights;  // ops/ops.h
}

namespace bert::model {

// y = x W^T + b with <name>.weight (out, in) and <name>.bias (out). When quantizable, its
// input passes through <name>.input_quantizer (per tensor) and its weight through
// <name>.weight_quantizer (per output channel, or one scale for the weight: WeightScales); both are
// pass-through until enabled. Layers that read
// one tensor at one scale (Q, K and V) share an input quantizer their owner holds (shared_input).
struct Linear {
  std::string name;
  ParamId weight = -1, bias = -1;
  int64_t in = 0, out = 0;
  bool quantizable = false;
  Quantizer input_quantizer, weight_quantizer;  // input_quantizer unused (no name) when shared_input is set
  Quantizer* shared_input = nullptr;

  static Linear declare(ParameterArena<float>& params, const std::string& name, int64_t in, int64_t out,
                        bool quantizable = true, WeightScales weight_scales = WeightScales::kPerChannel);
  // Three quantizable layers of one (in) input without input quantizers of their own (the owner points
  // each shared_input at the quantizer they share), with their weights side by side in the arena, then
  // their biases, then their weight quantizers: the self-attention's Q, K and V projections, which
  // ops::self_attention multiplies as one (3 out, in) matrix on a GPU. The order draws the same initial
  // weights as declaring the layers one by one (biases and scales draw nothing); checkpoints store
  // parameters by name.
  static std::array<Linear, 3> declare_side_by_side(ParameterArena<float>& params,
                                                    const std::array<std::string, 3>& names, int64_t in, int64_t out,
                                                    WeightScales weight_scales);
  // The quantizer of this layer's input: its own or the shared one.
  Quantizer& input() { return shared_input ? *shared_input : input_quantizer; }
  const Quantizer& input() const { return shared_input ? *shared_input : input_quantizer; }
  Var forward(Graph<float>& g, ParameterArena<float>& params, Var x);
  // The same for an x that already went through input_quantizer (fused into the op that made it).
  // `quantized_weight`: the weight through weight_quantizer already (quantize_weights), or none.
  Var forward_quantized_input(Graph<float>& g, ParameterArena<float>& params, Var x, Var quantized_weight = {});
  // gelu(forward(x)) and gelu(forward_quantized_input(x)): one op on either path (ops::linear_gelu,
  // ops::int8_linear_gelu).
  Var forward_gelu(Graph<float>& g, ParameterArena<float>& params, Var x);
  Var forward_gelu_quantized_input(Graph<float>& g, ParameterArena<float>& params, Var x, Var quantized_weight = {});
  // The weights of `layers` through their weight quantizers as one op (ops::fake_quantize_many: one launch
  // each way on a GPU for a whole encoder layer's), in order, for their forward_quantized_input; empty
  // unless every layer fake-quantizes its weight in g (none off, calibrating or running integer GEMMs).
  static std::vector<Var> quantize_weights(Graph<float>& g, ParameterArena<float>& params,
                                           std::span<Linear* const> layers);
  // The weight as the product reads it: quantized_weight where given, else the parameter through
  // weight_quantizer (when quantizable).
  Var product_weight(Graph<float>& g, ParameterArena<float>& params, Var quantized_weight);
  // input() when the op making this layer's input must apply it, else nullptr: a layer without
  // quantizers, or one running integer GEMMs in g on FP32 activations (ops::int8_linear quantizes its input
  // itself). On BF16 activations the integer layer's producer quantizes too, as in the fake-quantized model:
  // a fused quantizer rounds the producer's FP32 value, which the BF16 copy alone would not always give;
  // ops::int8_linear recovers those integers from the fake-quantized BF16 values exactly.
  Quantizer* used_input_quantizer(const Graph<float>& g) {
    return quantizable && quantizes_input(g) ? &input() : nullptr;
  }
  bool quantizes_input(const Graph<float>& g) const { return !runs_integer(g) || g.activation_dtype() == DType::kBF16; }
  // Whether forward() is ops::linear itself: no quantizer enabled (a float model, or one not calibrated
  // yet), so no integer path either.
  bool runs_float() const {
    return !quantizable || (input().mode == QuantMode::kFloat && weight_quantizer.mode == QuantMode::kFloat);
  }

  // INT8 inference: the weight quantized with its quantizer's scales and packed for the integer kernels,
  // and where the arena is on a GPU copied there too (ops::DeviceInt8Weights); forward() then runs
  // ops::int8_linear wherever the graph records no gradients, on the CPU or that GPU (while training, the
  // float path as before). Only when both quantizers are enabled (returns whether it did); call again
  // after the weights or scales change.
  bool prepare_integer(ParameterArena<float>& params);
  // The weight as int8 (out, in), rounded and clamped as its quantizer's fake quantization does.
  std::vector<int8_t> quantized_weight(ParameterArena<float>& params) const;
  // The weight quantizer's scale of each output channel (out values; a per-tensor scale repeated).
  std::vector<float> weight_scales(ParameterArena<float>& params) const;
  void clear_integer() {
    integer_weights.reset();
    device_integer_weights.reset();
  }
  std::shared_ptr<const Int8Weights> integer_weights;
  std::shared_ptr<const ops::DeviceInt8Weights> device_integer_weights;  // null unless prepared on a GPU
  // Whether forward() runs the integer path in g (prepared for g's device, no gradients, both quantizers
  // enabled).
  bool runs_integer(const Graph<float>& g) const;
  // The input quantizer's (per-tensor) scale.
  float input_scale(ParameterArena<float>& params) const;
  // The fake-quantized float path in inference (CPU or GPU) sums its integer operands exactly
  // (ops::exact_quantized_linear: the integer engine's values, bit for bit) where both quantizers are
  // enabled at 8 bits with a per-tensor input scale; off (the test's baseline), ops::linear sums the
  // fake-quantized floats as they are.
  bool exact_sums = true;
  bool sums_exactly(const Graph<float>& g, ParameterArena<float>& params) const;
  // Quantization-aware training on a GPU: the forward product on the integers behind the fake-quantized input
  // and weight (ops::quantized_linear: int8 tensor cores, exact sums) where both quantizers are enabled at
  // 8 bits, the input's per tensor and the weight's per output channel; off, ops::linear on the fake-quantized
  // floats. The backward is the same either way.
  bool integer_training = true;
  bool trains_on_integers(const Graph<float>& g, ParameterArena<float>& params) const;

 private:
  Var integer_forward(Graph<float>& g, ParameterArena<float>& params, Var x, bool gelu = false) const;
};

// LayerNorm over the last axis with <name>.weight (gamma) and <name>.bias (beta).
struct LayerNorm {
  std::string name;
  ParamId gamma = -1, beta = -1;
  double eps = 1e-12;

  static LayerNorm declare(ParameterArena<float>& params, const std::string& name, int64_t size, double eps);
  Var forward(Graph<float>& g, ParameterArena<float>& params, Var x) const;
  // forward(a + b): a residual connection's add and its LayerNorm as one op (ops::add_layer_norm).
  Var forward_sum(Graph<float>& g, ParameterArena<float>& params, Var a, Var b) const;
  // LayerNorm(dropout(a) + b) (ops::dropout_add_layer_norm: one kernel each way on a GPU).
  Var forward_dropout_sum(Graph<float>& g, ParameterArena<float>& params, Var a, Var b, double p, bool training,
                          Rng& rng) const;
  // LayerNorm(q(dropout(a)) + b) with the add's input quantizer q in the same op.
  Var forward_dropout_sum(Graph<float>& g, ParameterArena<float>& params, Var a, Var b, double p, bool training,
                          Rng& rng, const ops::QuantizeOutput& q) const;
};

}  // namespace bert::model
