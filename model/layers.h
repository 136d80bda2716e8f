// The model's parametrised building blocks, each declaring its parameters in the arena under Hugging
// Face state-dict names and applying core ops in forward().
#pragma once

#include <string>

#include "core/arena.h"
#include "core/graph.h"
#include "model/quantizer.h"

namespace bert::model {

// y = x W^T + b with <name>.weight (out, in) and <name>.bias (out). When quantizable, its
// input passes through <name>.input_quantizer (per tensor) and its weight through
// <name>.weight_quantizer (per output channel); both are pass-through until enabled.
struct Linear {
  std::string name;
  ParamId weight = -1, bias = -1;
  int64_t in = 0, out = 0;
  bool quantizable = false;
  Quantizer input_quantizer, weight_quantizer;

  static Linear declare(ParameterArena<float>& params, const std::string& name, int64_t in, int64_t out,
                        bool quantizable = true);
  Var forward(Graph<float>& g, ParameterArena<float>& params, Var x);
  // The same for an x that already went through input_quantizer (fused into the op that made it).
  Var forward_quantized_input(Graph<float>& g, ParameterArena<float>& params, Var x);
  // input_quantizer when this layer uses it, else nullptr.
  Quantizer* used_input_quantizer() { return quantizable ? &input_quantizer : nullptr; }
};

// LayerNorm over the last axis with <name>.weight (gamma) and <name>.bias (beta).
struct LayerNorm {
  std::string name;
  ParamId gamma = -1, beta = -1;
  double eps = 1e-12;

  static LayerNorm declare(ParameterArena<float>& params, const std::string& name, int64_t size, double eps);
  Var forward(Graph<float>& g, ParameterArena<float>& params, Var x) const;
};

}  // namespace bert::model
