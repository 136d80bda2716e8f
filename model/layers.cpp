#include "model/layers.h"

#include "core/ops.h"

namespace bert::model {

Linear Linear::declare(ParameterArena<float>& params, const std::string& name, int64_t in, int64_t out,
                       bool quantizable) {
  Linear l;
  l.name = name;
  l.in = in;
  l.out = out;
  l.weight = params.add(name + ".weight", {out, in});
  l.bias = params.add(name + ".bias", {out});
  l.quantizable = quantizable;
  if (quantizable) {
    l.input_quantizer = Quantizer::activation(params, name + ".input_quantizer");
    l.weight_quantizer = Quantizer::weight(params, name + ".weight_quantizer", out);
  }
  return l;
}

Var Linear::forward(Graph<float>& g, ParameterArena<float>& params, Var x) {
  if (quantizable) x = input_quantizer.apply(g, params, x);
  return forward_quantized_input(g, params, x);
}

Var Linear::forward_quantized_input(Graph<float>& g, ParameterArena<float>& params, Var x) {
  Var w = g.param(params.get(weight));
  if (quantizable) w = weight_quantizer.apply(g, params, w);
  return ops::linear(g, x, w, g.param(params.get(bias)));
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

}  // namespace bert::model
