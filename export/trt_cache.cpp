#include "export/trt_cache.h"

#include <onnx/shape_inference/implementation.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "export/bert_onnx.h"
#include "ort/runner.h"
#include "quant/calibrator.h"
#include "sys/atomic_file.h"
#include "sys/error.h"
#include "sys/text_file.h"

namespace bert::exporter {

std::vector<std::string> activation_tensors(const onnx::ModelProto& model) {
  onnx::ModelProto inferred = model;
  onnx::shape_inference::InferShapes(inferred);
  std::map<std::string, int32_t> types;
  for (const auto& v : inferred.graph().value_info()) types[v.name()] = v.type().tensor_type().elem_type();
  for (const auto& v : inferred.graph().output()) types[v.name()] = v.type().tensor_type().elem_type();
  std::vector<std::string> names;
  for (const auto& n : inferred.graph().node())
    for (const auto& out : n.output()) {
      auto it = types.find(out);
      if (it == types.end()) throw UserError("shape inference gave no type for tensor '" + out + "'");
      if (it->second == onnx::TensorProto::FLOAT) names.push_back(out);
    }
  return names;
}

std::vector<std::string> cache_tensors(const onnx::ModelProto& model) {
  std::vector<std::string> names;
  for (const std::string& name : activation_tensors(model)) {
    const bool mask_path = name.rfind("bert.attention_mask.", 0) == 0;
    const bool pre_softmax = name.ends_with(".masked_scores") || name.ends_with(".scaled_scores");
    const bool inside_an_op = name.find(".gelu.") != std::string::npos || name.find("LayerNorm.") != std::string::npos;
    if (!mask_path && !pre_softmax && !inside_an_op) names.push_back(name);
  }
  return names;
}

std::set<std::string> bounded_tensors(const onnx::ModelProto& model) {
  std::set<std::string> names;
  for (const auto& n : model.graph().node())
    if (n.op_type() == "Softmax" || n.op_type() == "Tanh" || n.op_type() == "Sigmoid")
      for (const auto& out : n.output()) names.insert(out);
  return names;
}

onnx::ModelProto with_outputs(const onnx::ModelProto& model, const std::vector<std::string>& names) {
  onnx::ModelProto m = model;
  std::set<std::string> present;
  for (const auto& o : m.graph().output()) present.insert(o.name());
  for (const std::string& name : names) {
    if (present.count(name)) continue;
    onnx::ValueInfoProto* v = m.mutable_graph()->add_output();
    v->set_name(name);
    v->mutable_type()->mutable_tensor_type()->set_elem_type(onnx::TensorProto::FLOAT);
  }
  return m;
}

std::map<std::string, double> calibrate_tensors(const onnx::ModelProto& fp32, data::ShardLoader& loader,
                                                const CacheOptions& o) {
  const quant::Method method = quant::parse_method(o.calibrator);
  const std::vector<std::string> names = cache_tensors(fp32);
  const std::string instrumented = o.work_dir + "/instrumented.onnx";
  write_onnx(with_outputs(fp32, names), instrumented);
  const std::vector<Batch> batches = ort::take_batches(loader, o.batches);
  if (batches.empty()) throw UserError("calibration for the TensorRT cache found no batches");
  // Every activation comes back as a binary tensor, batch by batch, into the calibrators' own histogram
  // (the one PTQ uses on our engine): ONNX Runtime only runs the graph.
  std::map<std::string, quant::AbsHistogram> histograms;
  for (const std::string& name : names) histograms[name];
  ort::stream_onnx_runtime(o.ort_script, instrumented, ort::batch_feeds(batches, o.masked_positions), o.work_dir,
                           [&](int64_t, const std::string& name, std::span<const float> values) {
                             auto it = histograms.find(name);
                             if (it != histograms.end()) it->second.observe(values);
                           });
  std::filesystem::remove(instrumented);
  const std::set<std::string> bounded = bounded_tensors(fp32);
  std::map<std::string, double> amax;
  for (const auto& [name, histogram] : histograms) {
    if (histogram.count() == 0) throw UserError("ONNX Runtime returned no values for tensor '" + name + "'");
    amax[name] = quant::calibrated_amax(histogram, method, o.percentile, bounded.count(name) ? 1.0 : 0.0);
  }
  return amax;
}

std::string float_hex(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, 4);
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", bits);
  return buf;
}

float hex_float(const std::string& hex) {
  if (hex.size() != 8 || hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
    throw UserError("'" + hex + "' is not 8 hex digits");
  const uint32_t bits = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
  float value = 0;
  std::memcpy(&value, &bits, 4);
  return value;
}

void write_trt_cache(const std::string& path, const std::map<std::string, double>& amax, const CacheOptions& o) {
  const std::string algorithm = o.calibrator == "max" ? "MinMaxCalibration" : "EntropyCalibration2";
  std::string text = "TRT-" + std::to_string(o.trt_version) + "-" + algorithm + "\n";
  for (const auto& [name, a] : amax) text += name + ": " + float_hex(quant::scale_for_amax(a)) + "\n";
  write_text_file(path, text);
}

std::map<std::string, float> read_trt_cache(const std::string& path, std::string* header) {
  std::ifstream in(path);
  if (!in) throw UserError("cannot read calibration cache '" + path + "'");
  std::string line;
  if (!std::getline(in, line) || line.rfind("TRT-", 0) != 0)
    throw UserError("calibration cache '" + path + "' does not start with a TRT-<version>-<algorithm> header");
  if (header) *header = line;
  std::map<std::string, float> scales;
  for (int number = 2; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    const size_t colon = line.rfind(": ");
    if (colon == std::string::npos)
      throw UserError("calibration cache '" + path + "' line " + std::to_string(number) +
                      ": expected '<tensor>: <hex>'");
    try {
      scales[line.substr(0, colon)] = hex_float(line.substr(colon + 2));
    } catch (const UserError& e) {
      throw UserError("calibration cache '" + path + "' line " + std::to_string(number) + ": " + e.what());
    }
  }
  return scales;
}

}  // namespace bert::exporter
