// ONNX export verified by running it: the ONNX checker, then ONNX Runtime (npm onnxruntime-node, through
// scripts/ort_run.js) against our engine on the same inputs: FP32 within 1e-4 relative, Q/DQ against
// the fake-quantized model within float rounding, at two batch/sequence sizes (dynamic axes).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "core/json.h"
#include "export/bert_onnx.h"
#include "quant/calibrator.h"
#include "quant/quantize.h"
#include "tests/common/temp_dir.h"

namespace bert::exporter {
namespace {

struct Inputs {
  int64_t b, t;
  std::vector<int32_t> ids;
  std::vector<int8_t> mask, types;
};

Inputs make_inputs(int64_t b, int64_t t, int64_t vocab, uint64_t seed) {
  Inputs in{b, t, {}, {}, {}};
  Rng rng(seed);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t length = t - static_cast<int64_t>(rng.next_below(3));  // some rows padded
    for (int64_t j = 0; j < t; ++j) {
      in.ids.push_back(j >= length ? 0 : j == 0 ? 2 : static_cast<int32_t>(5 + rng.next_below(vocab - 5)));
      in.mask.push_back(j < length ? 1 : 0);
      in.types.push_back(j < length / 2 ? 0 : (j < length ? 1 : 0));
    }
  }
  return in;
}

// Our engine's logits at every position but 0 (M = B (T - 1), V) and the NSP logits (B, 2).
std::pair<std::vector<float>, std::vector<float>> engine(model::BertForPreTraining& m, const Inputs& in) {
  std::vector<int32_t> positions, targets;
  for (int64_t i = 0; i < in.b; ++i)
    for (int64_t j = 1; j < in.t; ++j) positions.push_back(static_cast<int32_t>(j)), targets.push_back(0);
  model::BertBatch batch{in.b, in.t, in.t - 1, in.ids, in.mask, in.types, positions, targets, {}};
  Graph<float> g;
  NoGradGuard<float> no_grad(g);
  Rng unused(0);
  model::PretrainingOutputs out = m.forward(g, batch, false, unused);
  return {std::vector<float>(g.value(out.mlm_logits).begin(), g.value(out.mlm_logits).end()),
          std::vector<float>(g.value(out.nsp_logits).begin(), g.value(out.nsp_logits).end())};
}

// ONNX Runtime's outputs, in the same layout as engine().
std::pair<std::vector<float>, std::vector<float>> onnx_runtime(const std::string& model_path, const Inputs& in,
                                                               const testing::TempDir& dir, const std::string& optimized = "") {
  Json feeds;
  auto tensor = [&](auto const& values) {
    Json t;
    t["dims"] = Json::Array{Json(in.b), Json(in.t)};
    Json::Array data;
    for (auto v : values) data.emplace_back(static_cast<int64_t>(v));
    t["data"] = data;
    return t;
  };
  feeds["input_ids"] = tensor(in.ids);
  feeds["attention_mask"] = tensor(in.mask);
  feeds["token_type_ids"] = tensor(in.types);
  std::ofstream(dir.file("in.json")) << feeds.dump();
  const std::string command = "node " + std::string(BERT_SOURCE_DIR) + "/scripts/ort_run.js " + model_path + " " +
                              dir.file("in.json") + " " + dir.file("out.json") + " " + optimized + " 2>" + dir.file("ort.log");
  if (std::system(command.c_str()) != 0) {
    std::ifstream log(dir.file("ort.log"));
    std::stringstream text;
    text << log.rdbuf();
    ADD_FAILURE() << "ONNX Runtime failed: " << text.str();
    return {};
  }
  std::ifstream f(dir.file("out.json"));
  std::stringstream text;
  text << f.rdbuf();
  const Json out = Json::parse(text.str());
  const Json& logits = *out.find("prediction_logits");
  const int64_t v = logits.find("dims")->as_array()[2].as_int();
  std::vector<float> mlm;
  const auto& data = logits.find("data")->as_array();
  for (int64_t i = 0; i < in.b; ++i)
    for (int64_t j = 1; j < in.t; ++j)
      for (int64_t k = 0; k < v; ++k) mlm.push_back(static_cast<float>(data[(i * in.t + j) * v + k].as_number()));
  std::vector<float> nsp;
  for (const Json& x : out.find("seq_relationship_logits")->find("data")->as_array()) nsp.push_back(static_cast<float>(x.as_number()));
  return {mlm, nsp};
}

double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - b[i]));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return diff / std::max(scale, 1e-30);
}

model::BertConfig small_config() {
  model::BertConfig c;
  c.vocab_size = 60;
  c.hidden_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.intermediate_size = 64;
  c.max_position_embeddings = 32;
  c.initializer_range = 0.2;  // larger than BERT's so every path carries signal
  return c;
}

// Calibrates every quantizer (residual inputs too) with max on one batch, and enables them.
void quantize_all(model::BertForPreTraining& m, const Inputs& in) {
  quant::CalibrationStatistics stats;
  stats.quantizers = m.quantizers();
  for (model::Quantizer* q : stats.quantizers)
    if (!q->is_weight) q->observer = &stats.activations[q->name], q->mode = model::QuantMode::kCalibrate;
  engine(m, in);
  quant::apply_calibration(m, stats, quant::Method::kPercentile, 99.9);  // some values saturate
}

TEST(OnnxExport, Fp32MatchesOurEngineInOnnxRuntimeAtTwoShapes) {
  for (int opset : {17, 13}) {
    SCOPED_TRACE("opset " + std::to_string(opset));
    model::BertForPreTraining m(small_config());
    m.initialize(3);
    ExportOptions options;
    options.opset = opset;
    options.metadata["framework"] = "bert-qat test";
    onnx::ModelProto proto = export_bert(m, options);
    check_onnx(proto);
    testing::TempDir dir;
    write_onnx(proto, dir.file("model.onnx"));
    EXPECT_EQ(read_onnx(dir.file("model.onnx")).metadata_props(0).value(), "bert-qat test");
    for (auto [b, t] : {std::pair<int64_t, int64_t>{2, 8}, {3, 13}}) {
      const Inputs in = make_inputs(b, t, 60, 11 + b);
      auto [ours_mlm, ours_nsp] = engine(m, in);
      auto [ort_mlm, ort_nsp] = onnx_runtime(dir.file("model.onnx"), in, dir);
      EXPECT_LT(relative_error(ort_mlm, ours_mlm), 1e-4) << b << "x" << t;
      EXPECT_LT(relative_error(ort_nsp, ours_nsp), 1e-4) << b << "x" << t;
    }
  }
}

TEST(OnnxExport, QdqMatchesTheFakeQuantizedModelAndRunsWithIntegerKernels) {
  model::BertForPreTraining m(small_config());
  m.initialize(5);
  quantize_all(m, make_inputs(4, 12, 60, 1));
  ExportOptions options;
  options.qdq = true;
  onnx::ModelProto proto = export_bert(m, options);
  check_onnx(proto);
  int q = 0, dq = 0;
  for (const auto& n : proto.graph().node()) q += n.op_type() == "QuantizeLinear", dq += n.op_type() == "DequantizeLinear";
  EXPECT_EQ(q, static_cast<int>(m.quantizers().size()));
  EXPECT_EQ(dq, q);
  testing::TempDir dir;
  write_onnx(proto, dir.file("qdq.onnx"));
  for (auto [b, t] : {std::pair<int64_t, int64_t>{2, 8}, {3, 13}}) {
    const Inputs in = make_inputs(b, t, 60, 21 + b);
    auto [ours_mlm, ours_nsp] = engine(m, in);
    auto [ort_mlm, ort_nsp] = onnx_runtime(dir.file("qdq.onnx"), in, dir, dir.file("optimized.onnx"));
    // Same quantization grid, ops in a different order: float rounding can move a value across a rounding
    // boundary now and then, so the bar is a small fraction of the logits' scale, not 1e-4.
    EXPECT_LT(relative_error(ort_mlm, ours_mlm), 2e-3) << b << "x" << t;
    EXPECT_LT(relative_error(ort_nsp, ours_nsp), 2e-3) << b << "x" << t;
  }
  // ONNX Runtime's optimised graph runs the quantized MatMuls with integer kernels.
  std::map<std::string, int> ops;
  const onnx::ModelProto optimized = read_onnx(dir.file("optimized.onnx"));  // kept alive for the loop
  for (const auto& n : optimized.graph().node()) ++ops[n.op_type()];
  std::string listing;
  for (auto& [op, n] : ops) listing += op + ":" + std::to_string(n) + " ";
  EXPECT_GT(ops["QLinearMatMul"] + ops["MatMulInteger"] + ops["MatMulIntegerToFloat"] + ops["DynamicQuantizeMatMul"], 0)
      << listing;
  std::cout << "[ info ] ONNX Runtime optimized Q/DQ graph: " << listing << "\n";
}

}  // namespace
}  // namespace bert::exporter
