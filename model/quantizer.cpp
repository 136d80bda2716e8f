#include "model/quantizer.h"

#include <cmath>

#include "core/error.h"
#include "core/ops.h"

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
      // LSQ's gradient scale 1 / sqrt(N * qmax), N = elements per scale: a weight row, or one example
      // of an activation (the first axis is the batch).
      const int64_t per_scale = is_weight ? s.numel() / channels : s.numel() / std::max<int64_t>(s[0], 1);
      const double grad_scale = 1.0 / std::sqrt(static_cast<double>(per_scale) * qmax);
      int64_t* counter = &clipped;
      if (g.on_cuda()) {
        BERT_CHECK(device_clipped, "quantizer '" + name + "' has no counter on the GPU (Bert::place_on)");
        counter = device_clipped;
      }
      Var y = ops::fake_quantize(g, x, g.param(params.get(scale)), qmin, qmax, grad_scale, counter);
      seen += s.numel();
      return y;
    }
  }
  return x;
}

bool is_quantizer_scale(const std::string& parameter_name) { return parameter_name.ends_with("_quantizer.scale"); }

}  // namespace bert::model
