#include "model/quantizer.h"

#include <algorithm>
#include <cmath>

#include "ops/ops.h"
#include "sys/error.h"

namespace bert::model {

Quantizer Quantizer::activation(ParameterArena<float>& params, const std::string& name) {
  Quantizer q;
  q.name = name;
  q.scale = params.add(name + ".scale", {1});
  return q;
}

Quantizer Quantizer::weight(ParameterArena<float>& params, const std::string& name, int64_t out_channels) {
  Quantizer q;
  q.name = name;
  q.channels = out_channels;
  q.is_weight = true;
  q.qmin = -127;  // narrow: with scale = amax / 127 the weights never reach -128
  q.scale = params.add(name + ".scale", {out_channels});
  return q;
}

Var Quantizer::apply(Graph<float>& g, ParameterArena<float>& params, Var x) {
  switch (mode) {
    case QuantMode::kFloat:
      return x;
    case QuantMode::kCalibrate: {
      BERT_CHECK(observer, "quantizer '" + name + "' is calibrating without an observer");
      observer->observe(g, x);
      return x;
    }
    case QuantMode::kQuantize: {
      const Shape s = g.shape(x);
      if (!is_weight) {
        const ops::QuantizeOutput q = fused_output(g, params, s);
        return ops::fake_quantize(g, x, q.scale, q.qmin, q.qmax, q.grad_scale, q.clipped, q.integers);
      }
      const ops::QuantizeOutput q = weight_output(g, params, s);
      return ops::fake_quantize(g, x, q.scale, q.qmin, q.qmax, q.grad_scale, q.clipped);
    }
  }
  return x;
}

int64_t* Quantizer::counter(const Graph<float>& g) {
  if (!g.on_cuda()) return &clipped;
  BERT_CHECK(device_clipped, "quantizer '" + name + "' has no counter on the GPU (Bert::place_on)");
  return device_clipped;
}

ops::QuantizeOutput Quantizer::weight_output(Graph<float>& g, ParameterArena<float>& params, const Shape& shape) {
  BERT_CHECK(is_weight && mode == QuantMode::kQuantize, "quantizer '" + name + "' is not a weight's, fake-quantizing");
  ops::QuantizeOutput q;
  q.scale = g.param(params.get(scale));
  q.qmin = qmin;
  q.qmax = qmax;
  // LSQ's gradient scale 1 / sqrt(N * qmax), N = elements per scale: here a weight row.
  q.grad_scale = 1.0 / std::sqrt(static_cast<double>(shape.numel() / channels) * qmax);
  q.clipped = counter(g);
  seen += shape.numel();
  return q;
}

ops::QuantizeOutput Quantizer::fused_output(Graph<float>& g, ParameterArena<float>& params, const Shape& shape) {
  BERT_CHECK(!is_weight && channels == 1, "quantizer '" + name + "': only per-tensor activations fuse into an op");
  // LSQ's gradient scale 1 / sqrt(N * qmax), N = elements per scale: one example of the activation (the
  // first axis is the batch).
  const int64_t per_scale = shape.numel() / std::max<int64_t>(shape[0], 1);
  ops::QuantizeOutput q;
  q.scale = g.param(params.get(scale));
  q.qmin = qmin;
  q.qmax = qmax;
  q.grad_scale = 1.0 / std::sqrt(static_cast<double>(per_scale) * qmax);
  q.clipped = counter(g);
  q.integers = integers_read && g.on_cuda() && g.grad_enabled();
  seen += shape.numel();
  return q;
}

bool is_quantizer_scale(const std::string& parameter_name) { return parameter_name.ends_with("_quantizer.scale"); }

}  // namespace bert::model
