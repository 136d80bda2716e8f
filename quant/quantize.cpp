#include "quant/quantize.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "sys/atomic_file.h"
#include "sys/error.h"
#include "sys/text_file.h"

namespace bert::quant {

bool glob_match(const std::string& pattern, const std::string& name) {
  // Iterative wildcard matching with backtracking to the last '*'.
  size_t p = 0, n = 0, star = std::string::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p, ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (star != std::string::npos) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

std::vector<model::Quantizer*> select(model::Bert& model, const std::string& globs) {
  std::vector<std::string> patterns;
  std::stringstream in(globs);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) patterns.push_back(item);
  std::vector<model::Quantizer*> chosen;
  for (const std::string& pattern : patterns) {
    bool matched = false;
    for (model::Quantizer* q : model.quantizers()) {
      if (!glob_match(pattern, q->name)) continue;
      matched = true;
      if (std::find(chosen.begin(), chosen.end(), q) == chosen.end()) chosen.push_back(q);
    }
    if (!matched)
      throw UserError("no quantizer matches '" + pattern +
                      "' (names look like "
                      "bert.encoder.layer.0.attention.self.input_quantizer)");
  }
  return chosen;
}

std::vector<model::Quantizer*> default_quantizers(model::Bert& model, bool residuals) {
  std::vector<model::Quantizer*> chosen;
  for (model::Quantizer* q : model.quantizers())
    if (residuals || q->name.find(".add_") == std::string::npos) chosen.push_back(q);
  return chosen;
}

void CalibrationOptions::validate() const {
  if (!(percentile > 0 && percentile <= 100)) throw UserError("--percentile must be in (0, 100]");
  if (batches < 1) throw UserError("--calib-batches must be at least 1");
}

std::vector<model::Quantizer*> chosen_quantizers(model::Bert& model, const CalibrationOptions& o) {
  std::vector<model::Quantizer*> chosen =
      o.include.empty() ? default_quantizers(model, o.residuals) : select(model, o.include);
  if (!o.keep_float_globs.empty())
    for (model::Quantizer* q : select(model, o.keep_float_globs)) std::erase(chosen, q);
  std::set<std::string> all;
  for (model::Quantizer* q : model.quantizers()) all.insert(q->name);
  for (const std::string& name : o.keep_float)
    if (!all.count(name)) throw UserError("plan keeps '" + name + "' in float, but the model has no such quantizer");
  std::erase_if(chosen, [&](model::Quantizer* q) {
    return std::find(o.keep_float.begin(), o.keep_float.end(), q->name) != o.keep_float.end();
  });
  return chosen;
}

CalibrationStatistics collect_statistics(model::Bert& model, data::ShardLoader& loader, const CalibrationOptions& o,
                                         Graph<float>& g) {
  o.validate();
  CalibrationStatistics stats;
  stats.quantizers = chosen_quantizers(model, o);
  disable_all(model);
  for (model::Quantizer* q : stats.quantizers) {
    if (q->is_weight) continue;
    q->observer = &stats.activations[q->name];
    q->mode = model::QuantMode::kCalibrate;
  }
  NoGradGuard<float> no_grad(g);
  Batch batch;
  Rng unused(0);
  while (stats.batches < o.batches && loader.next(batch)) {
    model.forward(g, batch.view(), /*training=*/false, unused);
    g.clear();
    ++stats.batches;
    stats.sequences += batch.size;
  }
  for (model::Quantizer* q : stats.quantizers) {
    q->observer = nullptr;
    q->mode = model::QuantMode::kFloat;
  }
  if (stats.batches == 0) throw UserError("calibration found no batches in the given shards");
  return stats;
}

std::map<std::string, double> apply_calibration(model::Bert& model, const CalibrationStatistics& stats, Method method,
                                                double percentile) {
  disable_all(model);
  std::map<std::string, double> amax;
  ParameterArena<float>& params = model.parameters();
  for (model::Quantizer* q : stats.quantizers) {
    TensorView<float> scale = params.get(q->scale).value;
    if (q->is_weight) {
      // The weight belongs to the Linear named by the quantizer's prefix.
      const std::string linear = q->name.substr(0, q->name.size() - std::string(".weight_quantizer").size());
      TensorView<float> w = params.get(linear + ".weight").value;
      const int64_t per_row = w.numel() / q->channels;
      double largest = 0;
      for (int64_t c = 0; c < q->channels; ++c) {
        float m = 0;
        for (int64_t i = 0; i < per_row; ++i) m = std::max(m, std::abs(w[c * per_row + i]));
        scale[c] = scale_for_amax(m);
        largest = std::max<double>(largest, m);
      }
      amax[q->name] = largest;
    } else {
      const double a = calibrated_amax(stats.activations.at(q->name), method, percentile, q->bound);
      scale[0] = scale_for_amax(a);
      amax[q->name] = a;
    }
    q->mode = model::QuantMode::kQuantize;
  }
  params.upload_values();  // the new scales, where the model runs (a no-op on the CPU)
  return amax;
}

std::map<std::string, double> calibrate(model::Bert& model, data::ShardLoader& loader,
                                        const CalibrationOptions& options, Graph<float>& g) {
  return apply_calibration(model, collect_statistics(model, loader, options, g), options.method,
                           options.percentile);
}

Json describe_calibration(const CalibrationOptions& o, int64_t batches_used, model::WeightScales weights) {
  Json recipe;
  recipe["calibrator"] = method_name(o.method);
  recipe["weights"] = model::weight_scales_name(weights);
  recipe["percentile"] = o.percentile;
  recipe["calib_batches"] = batches_used;
  recipe["quantize_residuals"] = o.residuals;
  recipe["quantize"] = o.include;
  recipe["keep_float_globs"] = o.keep_float_globs;
  Json::Array kept;
  for (const auto& n : o.keep_float) kept.emplace_back(n);
  recipe["keep_float"] = kept;
  return recipe;
}

std::vector<std::string> fully_saturated_channels(model::Bert& model) {
  std::vector<std::string> dead;
  for (model::Quantizer* q : model.enabled_quantizers()) {
    if (!q->is_weight) continue;
    const TensorView<float> w = model.parameters().get(model.quantized_weight(*q)).value;  // (out, in)
    const TensorView<float> s = model.parameters().get(q->scale).value;  // (rows) or one per-tensor scale
    const int64_t rows = w.shape()[0], cols = w.numel() / rows;
    for (int64_t r = 0; r < rows; ++r) {
      const float scale = s.numel() == 1 ? s[0] : s[r];
      bool all_clipped = cols > 0;
      for (int64_t c = 0; c < cols && all_clipped; ++c) all_clipped = std::abs(w[r * cols + c]) / scale > 127.5f;
      if (all_clipped) dead.push_back(q->name + "[" + std::to_string(r) + "]");
    }
  }
  return dead;
}

Json scale_floors(model::Bert& model) {
  Json floors = Json::Object{};
  for (model::Quantizer* q : model.enabled_quantizers()) {
    float smallest = std::numeric_limits<float>::infinity();
    for (float s : model.parameters().get(q->scale).value) smallest = std::min(smallest, s);
    floors[q->name] = std::max<double>(kMinimumScale, kScaleFloorFraction * smallest);
  }
  return floors;
}

void disable_all(model::Bert& model) {
  for (model::Quantizer* q : model.quantizers()) {
    q->mode = model::QuantMode::kFloat;
    q->observer = nullptr;
  }
}

std::vector<std::string> read_plan(const std::string& path, model::Bert& model) {
  const std::string text = read_text_file(path, "plan file");
  Json plan;
  try {
    plan = Json::parse(text);
  } catch (const UserError& e) {
    throw UserError("plan file '" + path + "': " + e.what());
  }
  const Json* keep = plan.is_object() ? plan.find("keep_float") : nullptr;
  if (!keep || !keep->is_array()) throw UserError("plan file '" + path + "' has no \"keep_float\" list");
  std::set<std::string> all;
  for (model::Quantizer* q : model.quantizers()) all.insert(q->name);
  std::vector<std::string> names;
  for (const Json& n : keep->as_array()) {
    // A plan of the earlier layout keeps one of Q, K, V's input quantizers in float: their shared one now.
    const std::string name = n.is_string() ? model::Bert::current_quantizer_name(n.as_string()) : "";
    if (!all.count(name))
      throw UserError("plan file '" + path + "' names '" + (n.is_string() ? n.as_string() : n.dump()) +
                      "', which is not a quantizer of this model");
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

void write_plan(const std::string& path, const std::vector<std::string>& keep_float, const Json& details) {
  Json plan = details.is_object() ? details : Json();
  Json::Array names;
  for (const std::string& n : keep_float) names.emplace_back(n);
  plan["keep_float"] = names;
  write_text_file(path, plan.dump(2) + "\n");
}

}  // namespace bert::quant
