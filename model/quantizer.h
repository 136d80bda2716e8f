// Quantizer: one fake-quantization point in the model, with a stable readable name (the same name is
// used by logs, the sensitivity table, plan files, the calibration cache and the ONNX export), a
// learnable scale parameter "<name>.scale" in the arena, and a mode. Calibration algorithms, the
// registry operations (enable by name or glob) and sensitivity analysis live in quant/.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/graph.h"
#include "ops/ops.h"

namespace bert::model {

enum class QuantMode {
  kFloat,      // pass-through: the model runs in FP32 at this point
  kCalibrate,  // pass-through, and the observer sees the values (to choose a scale)
  kQuantize,   // fake-quantize with the scale parameter (LSQ gradient when training)
};

// Receives the values a quantizer sees while calibrating. Implemented by quant/'s calibrators.
class QuantObserver {
 public:
  virtual ~QuantObserver() = default;
  virtual void observe(std::span<const float> values) = 0;
  // An activation of a graph, on its device: by default copied to the host for observe(values); an
  // observer that can gather its statistics on the device overrides this.
  virtual void observe(Graph<float>& g, Var x) {
    const std::vector<float> values = g.to_host(x);
    observe(std::span<const float>(values));
  }
};

struct Quantizer {
  std::string name;
  ParamId scale = -1;  // (channels): 1 for per-tensor activations, out for per-channel weights
  int64_t channels = 1;
  bool is_weight = false;  // weights: per output channel, narrow range [-127, 127]
  // A quantized linear reading this (activation) quantizer's output multiplies the integers behind it
  // (Linear::trains_on_integers): on a GPU training step the op that quantizes writes them too.
  bool integers_read = false;
  int qmin = -128, qmax = 127;
  // |x| never exceeds this when it is known (> 0; the attention probabilities: 1). Calibration never
  // clips such a tensor: every method gives it amax = bound (quant::calibrated_amax).
  double bound = 0;
  QuantMode mode = QuantMode::kFloat;
  QuantObserver* observer = nullptr;  // used in kCalibrate mode
  int64_t clipped = 0, seen = 0;      // saturated / total elements since the last reset_counts()
  int64_t* device_clipped = nullptr;  // on a GPU: the counter there (Bert::collect_clip_counts)

  static Quantizer activation(ParameterArena<float>& params, const std::string& name);
  static Quantizer weight(ParameterArena<float>& params, const std::string& name, int64_t out_channels);
  Var apply(Graph<float>& g, ParameterArena<float>& params, Var x);
  // This (activation) quantizer in kQuantize mode as an ops::QuantizeOutput, for an op that fuses it;
  // `shape` is the op's output shape. Counts the elements as apply() does.
  ops::QuantizeOutput fused_output(Graph<float>& g, ParameterArena<float>& params, const Shape& shape);
  // This (weight) quantizer in kQuantize mode as the arguments of its fake_quantize, for a weight of
  // `shape` (ops::fake_quantize_many: several weights in one op). Counts the elements as apply() does.
  ops::QuantizeOutput weight_output(Graph<float>& g, ParameterArena<float>& params, const Shape& shape);
  // make(q) is the op that makes this quantizer's input, with q (const ops::QuantizeOutput*) fused into it.
  // In kQuantize mode with `fuse`, make(&fused_output(...)); otherwise make(nullptr) then apply() (pass-
  // through, calibration, or the unfused sequence).
  template <typename Make>
  Var apply_fused(Graph<float>& g, ParameterArena<float>& params, const Shape& shape, bool fuse, Make make) {
    if (mode != QuantMode::kQuantize || !fuse) return apply(g, params, make(nullptr));
    const ops::QuantizeOutput q = fused_output(g, params, shape);
    return make(&q);
  }
  void reset_counts() { clipped = seen = 0; }

 private:
  int64_t* counter(const Graph<float>& g);  // where saturations are counted: host, or device_clipped
};

// True for the arena names of quantizer scales (no weight decay; optional in FP32 checkpoints).
bool is_quantizer_scale(const std::string& parameter_name);

}  // namespace bert::model
