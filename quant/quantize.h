// Quantizing a model: choosing quantizers by name or glob, calibrating them on batches (PTQ, and the
// start of QAT), keeping scales positive, and plan files (which quantizers stay in float).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/graph.h"
#include "data/loader.h"
#include "model/bert.h"
#include "quant/calibrator.h"
#include "sys/json.h"

namespace bert::quant {

// Quantizers whose names match any of the comma-separated globs (* and ? wildcards). UserError naming a
// glob that matches nothing.
std::vector<model::Quantizer*> select(model::Bert& model, const std::string& globs);
bool glob_match(const std::string& pattern, const std::string& name);

// The default set for BERT, as NVIDIA's QDQBERT: every Linear's input and weight, and the inputs of
// both attention matmuls; with `residuals` (the default of CalibrationOptions), both inputs of each
// residual add too, as NVIDIA's TensorRT recipe places them (the add then fuses with its LayerNorm and
// the tensor between layers stays INT8).
std::vector<model::Quantizer*> default_quantizers(model::Bert& model, bool residuals);

struct CalibrationOptions {
  Method method = Method::kPercentile;  // for activations (weights use max)
  double percentile = 99.99;
  int64_t batches = 16;
  bool residuals = true;                // both inputs of each residual add too (--no-quantize-residuals: not)
  std::string include;                  // comma-separated globs choosing the set instead of the default
  std::string keep_float_globs;         // comma-separated globs kept in float
  std::vector<std::string> keep_float;  // names kept in float (a sensitivity plan)
  void validate() const;
};

// The quantizers a calibration enables: options.include (globs) or the default set, minus
// keep_float_globs and the plan's keep_float names (UserError for a name the model lacks).
std::vector<model::Quantizer*> chosen_quantizers(model::Bert& model, const CalibrationOptions& options);

// The calibration part of a quantization recipe, as recorded in checkpoints and exports: calibrator,
// percentile, weight scales (per-channel or per-tensor), batches used, residuals, selection globs and the
// names kept in float.
Json describe_calibration(const CalibrationOptions& options, int64_t batches_used, model::WeightScales weights);

// Statistics of every activation quantizer in the chosen set, from one pass over calibration batches
// (no gradients, no dropout). Weights need no batches.
struct CalibrationStatistics {
  std::vector<model::Quantizer*> quantizers;  // the chosen set (weights and activations)
  std::map<std::string, AbsHistogram> activations;
  int64_t batches = 0, sequences = 0;
};
CalibrationStatistics collect_statistics(model::Bert& model, data::ShardLoader& loader,
                                         const CalibrationOptions& options, Graph<float>& g);

// Sets every chosen quantizer's scale (weights: max |w| / 127 per channel, or over the weight when
// per-tensor; activations: amax of
// `method` / 127) and enables it; every other quantizer goes to float. Returns {name: amax} (the
// largest channel's amax for weights).
std::map<std::string, double> apply_calibration(model::Bert& model, const CalibrationStatistics& stats, Method method,
                                                double percentile);

// All in one: collect, then apply `options.method`.
std::map<std::string, double> calibrate(model::Bert& model, data::ShardLoader& loader,
                                        const CalibrationOptions& options, Graph<float>& g);

// The absolute floor the optimizer keeps learned scales above (Optimizer::set_minimum): they stay positive.
constexpr float kMinimumScale = 1e-8f;
// QAT's floor for each quantizer's scales: this fraction of its smallest calibrated scale, so a learned
// scale can shrink 20-fold from where calibration put it but never collapse (a collapsed weight scale
// saturates its whole channel, which then learns nothing).
constexpr double kScaleFloorFraction = 0.05;
// {quantizer name: floor} for the enabled quantizers, from their current (calibrated) scales.
Json scale_floors(model::Bert& model);

// Weight channels of enabled weight quantizers whose every weight lies beyond the range (|w| / s above
// 127.5 everywhere in the channel): such a channel outputs its bias alone and, behind the
// straight-through mask, never gets a gradient again. Reads the arena's host values. Each entry is
// "<quantizer name>[<channel>]".
std::vector<std::string> fully_saturated_channels(model::Bert& model);

// Every quantizer to float.
void disable_all(model::Bert& model);

// Plan files: {"keep_float": [names...], ...}; reading checks every name exists in the model.
std::vector<std::string> read_plan(const std::string& path, model::Bert& model);
void write_plan(const std::string& path, const std::vector<std::string>& keep_float, const Json& details);

}  // namespace bert::quant
