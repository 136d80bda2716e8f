// The model against golden values from an independent PyTorch implementation (float64, stored in
// tests/fixtures/bert_golden.h5 by tests/golden/make_bert_golden.py): logits, losses and every
// parameter gradient. Also the config: JSON, presets, validation.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <memory>
#include <set>

#include "core/graph.h"
#include "core/rng.h"
#include "model/bert.h"
#include "model/config.h"
#include "ops/ops.h"
#include "sys/error.h"
#include "tests/common/fixtures.h"

namespace bert::model {
namespace {

// The golden fixtures: the float model (tests/golden/make_bert_golden.py), and the same with every quantizer of QAT on
// (tests/golden/make_qat_golden.py): scales among the parameters; the weights' per output channel, or one a weight.
enum class Golden { kFloat, kQat, kQatPerTensorWeights };
std::string golden_fixture(Golden which) {
  const char* name = which == Golden::kFloat ? "bert_golden.h5"
                     : which == Golden::kQat ? "bert_qat_golden.h5"
                                             : "bert_qat_per_tensor_golden.h5";
  return testing::fixtures_dir() + "/" + name;
}

// Reads a dataset of any numeric type, converted by HDF5 to T.
template <typename T>
std::vector<T> read_all(hid_t file, const std::string& name) {
  hid_t d = H5Dopen2(file, name.c_str(), H5P_DEFAULT);
  EXPECT_GE(d, 0) << name;
  hid_t space = H5Dget_space(d);
  std::vector<T> out(static_cast<size_t>(H5Sget_simple_extent_npoints(space)));
  H5Dread(d,
          std::is_same_v<T, float>    ? H5T_NATIVE_FLOAT
          : std::is_same_v<T, double> ? H5T_NATIVE_DOUBLE
                                      : H5T_NATIVE_INT32,
          H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data());
  H5Sclose(space);
  H5Dclose(d);
  return out;
}

std::string read_string_attribute(hid_t file, const char* name) {
  hid_t a = H5Aopen(file, name, H5P_DEFAULT);
  hid_t type = H5Aget_type(a);
  std::string value;
  if (H5Tis_variable_str(type) > 0) {
    char* s = nullptr;
    hid_t mem = H5Tcopy(H5T_C_S1);
    H5Tset_size(mem, H5T_VARIABLE);
    H5Tset_cset(mem, H5Tget_cset(type));
    H5Aread(a, mem, &s);
    value = s;
    H5free_memory(s);
    H5Tclose(mem);
  } else {
    value.resize(H5Tget_size(type));
    H5Aread(a, type, value.data());
  }
  H5Tclose(type);
  H5Aclose(a);
  return value;
}

// Relative error of a tensor: max |actual - expected| / max |expected|.
double relative_error(std::span<const float> actual, const std::vector<double>& expected) {
  EXPECT_EQ(actual.size(), expected.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    diff = std::max(diff, std::abs(double(actual[i]) - expected[i]));
    scale = std::max(scale, std::abs(expected[i]));
  }
  return diff / std::max(scale, 1e-30);
}

constexpr double kGoldenTolerance = 1e-4;  // float32 engine against a float64 reference
// TF32 tensor cores round GEMM inputs to 10 mantissa bits (relative steps of 2^-11), accumulating in
// FP32; measured on an H100: logits 9.2e-4, gradients 5.4e-3.
constexpr double kTf32Tolerance = 1e-2;
// A quantizer scale's gradient sums dy (round(v) - v) over every element the scale quantizes: terms of either
// sign that cancel to a small part of their magnitude, so the sum's float32 error is larger relative to it
// than a weight gradient's. Measured on the CPU (FP32): 8.6e-5 at most, the other gradients under 1e-5.
constexpr double kScaleGradientTolerance = 1e-3;
// BF16 mixed precision stores every activation and activation gradient with 8 mantissa bits (relative
// steps of 2^-8), several times per layer; the first layer's query and key gradients also pass through
// the softmax's backward, whose y (dy - sum y dy) cancels. Measured on an H100: logits 1.5e-2,
// gradients 6.5e-2 (layer 0's query and key).
constexpr double kBf16Tolerance = 5e-2;
constexpr double kBf16GradientTolerance = 1e-1;
// The task heads on the GPU in BF16, whose feed-forward GELU runs in cuBLASLt's epilogues (its tanh form,
// within 4.7e-4 of erf's, of the unrounded FP32 sums). Measured on an H200: gradients 1.14e-1 (the sequence
// classifier's; 5.4e-2 the token classifier's).
constexpr double kGpuBf16HeadsGradientTolerance = 1.5e-1;
// The regression head in BF16 on the GPU: its three examples' score gradients (-1.92, 0.34, 1.19) cancel to
// -0.40 in the parameters' gradients summed over them (their magnitudes add to 3.45), so each example's BF16
// rounding weighs up to 8.6 times more against the sum. Measured on an H200: 2.4e-1 (the last LayerNorm's
// weight; 1.5e-1 its output bias).
constexpr double kGpuBf16RegressionGradientTolerance = 3.5e-1;
// BF16 products on the CPU (operands rounded, FP32 sums, FP32 tensors). Measured (AMD EPYC, AVX512_BF16):
// MLM logits 7.7e-3, NSP logits 4.1e-2 (two small logits of a pooled [CLS]), gradients 8.8e-2 (layer 0's
// query and key, through the softmax's backward as above).
constexpr double kCpuBf16Tolerance = 5e-2;
constexpr double kCpuBf16GradientTolerance = 1.5e-1;

// Runs the golden batch on `device` and compares everything with the reference. With a QAT fixture every
// quantizer fake-quantizes with the reference's scales, whose gradients are compared too, as is the number of
// saturated values.
void check_golden(const Device& device, double tolerance = kGoldenTolerance, double gradient_tolerance = 0,
                  Golden which = Golden::kFloat) {
  if (gradient_tolerance == 0) gradient_tolerance = tolerance;
  const bool qat = which != Golden::kFloat;
  const std::string fixture = golden_fixture(which);
  hid_t f = H5Fopen(fixture.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0) << "missing fixture " << fixture;
  Bert model(BertConfig::from_json(Json::parse(read_string_attribute(f, "config"))));
  ParameterArena<float>& params = model.parameters();
  // The reference's parameters: the float fixture has no quantizer scales.
  auto compared = [&](ParamId id) { return qat || !is_quantizer_scale(params.name(id)); };
  if (qat)
    for (Quantizer* q : model.quantizers()) q->mode = QuantMode::kQuantize;
  int32_t model_parameters = 0;
  for (ParamId id = 0; id < params.size(); ++id) {
    if (!compared(id)) continue;
    ++model_parameters;
    std::vector<float> values = read_all<float>(f, "params/" + params.name(id));
    ASSERT_EQ(static_cast<int64_t>(values.size()), params.get(id).value.numel()) << params.name(id);
    std::copy(values.begin(), values.end(), params.get(id).value.data());
  }
  // Every parameter of the reference exists in the model (the decoder is tied, so it has none).
  hsize_t count = 0;
  hid_t group = H5Gopen2(f, "params", H5P_DEFAULT);
  H5Gget_num_objs(group, &count);
  H5Gclose(group);
  EXPECT_EQ(static_cast<int32_t>(count), model_parameters);

  std::vector<int32_t> ids = read_all<int32_t>(f, "inputs/input_ids"),
                       positions = read_all<int32_t>(f, "inputs/masked_positions"),
                       masked = read_all<int32_t>(f, "inputs/masked_ids");
  std::vector<int8_t> mask, types, labels;
  for (int32_t v : read_all<int32_t>(f, "inputs/attention_mask")) mask.push_back(static_cast<int8_t>(v));
  for (int32_t v : read_all<int32_t>(f, "inputs/token_type_ids")) types.push_back(static_cast<int8_t>(v));
  for (int32_t v : read_all<int32_t>(f, "inputs/next_sentence_labels")) labels.push_back(static_cast<int8_t>(v));
  BatchView batch{2, 8, 3, ids, mask, types, positions, masked, labels, {}, {}};
  std::vector<int32_t> rows;  // the masked positions' rows of the flattened batch (a 0 ends a row's list)
  for (int b = 0; b < 2; ++b)
    for (int j = 0; j < 3 && positions[b * 3 + j] != 0; ++j) rows.push_back(b * 8 + positions[b * 3 + j]);

  model.place_on(device);
  Graph<float> g(device);
  Rng rng(1);
  ModelOutputs out = model.forward(g, batch, /*training=*/true, rng);  // dropout is 0 in this config
  EXPECT_EQ(out.mlm_rows, rows);
  auto view = [&](Var v) { return g.to_host(v); };
  std::cout << "[ info ] " << device.name() << ": MLM logits relative error "
            << relative_error(view(out.mlm_logits), read_all<double>(f, "expected/mlm_logits")) << "\n";
  EXPECT_LT(relative_error(view(out.mlm_logits), read_all<double>(f, "expected/mlm_logits")), tolerance);
  EXPECT_LT(relative_error(view(out.nsp_logits), read_all<double>(f, "expected/nsp_logits")), tolerance);
  EXPECT_LT(relative_error(view(out.mlm_loss), read_all<double>(f, "expected/mlm_loss")), tolerance);
  EXPECT_LT(relative_error(view(out.nsp_loss), read_all<double>(f, "expected/nsp_loss")), tolerance);
  EXPECT_LT(relative_error(view(out.loss), read_all<double>(f, "expected/loss")), tolerance);

  g.backward(out.loss);
  params.download_grads();
  // Scale of the model's gradients, for tensors whose exact gradient is zero: the attention key biases
  // (softmax ignores a shift shared by a row's scores), about 1e-17 in the float64 reference, where a
  // relative error is meaningless. Those are held to 1e-4 of the largest gradient instead.
  double largest = 0;
  for (ParamId id = 0; id < params.size(); ++id)
    if (compared(id))
      for (double v : read_all<double>(f, "grads/" + params.name(id))) largest = std::max(largest, std::abs(v));
  int zero_gradient_tensors = 0;
  double worst_gradient = 0;
  for (ParamId id = 0; id < params.size(); ++id) {
    if (!compared(id)) continue;
    TensorView<float> grad = params.get(id).grad;
    const std::vector<double> expected = read_all<double>(f, "grads/" + params.name(id));
    double scale = 0, diff = 0;
    for (size_t i = 0; i < expected.size(); ++i) {
      scale = std::max(scale, std::abs(expected[i]));
      diff = std::max(diff, std::abs(double(grad[i]) - expected[i]));
    }
    if (scale < 1e-12 * largest) {
      ++zero_gradient_tensors;
      EXPECT_TRUE(params.name(id).ends_with("attention.self.key.bias")) << params.name(id);
      EXPECT_LT(diff, gradient_tolerance * largest) << params.name(id);
    } else {
      EXPECT_LT(diff / scale, is_quantizer_scale(params.name(id)) ? kScaleGradientTolerance : gradient_tolerance)
          << params.name(id);
      worst_gradient = std::max(worst_gradient, diff / scale);
    }
  }
  // Quantizing the keys breaks the softmax's invariance to a shift of a row's scores: their biases get
  // gradients then.
  EXPECT_EQ(zero_gradient_tensors, qat ? 0 : 2) << "one key bias per layer, in the float model";
  std::cout << "[ info ] " << device.name() << ": largest gradient relative error " << worst_gradient << "\n";
  if (qat) {
    model.collect_clip_counts();
    int64_t saturated = 0;
    for (const Quantizer* q : model.quantizers()) saturated += q->clipped;
    EXPECT_EQ(saturated, read_all<int32_t>(f, "expected/saturated").at(0));
  }
  H5Fclose(f);
}

TEST(BertGolden, LogitsLossesAndAllGradientsMatchPyTorch) { check_golden(Device::cpu()); }

// BF16 products on the CPU: every GEMM's operands rounded to 8 significant bits, FP32 sums and FP32 tensors
// (fewer roundings than the GPU's BF16 mixed precision, which also stores activations in BF16).
TEST(BertGolden, OnTheCpuWithBf16ProductsWithinTheirTolerance) {
  check_golden(*Device::open("cpu", Precision::kBf16), kCpuBf16Tolerance, kCpuBf16GradientTolerance);
}

TEST(BertGolden, OnTheGpuInFp32) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): the GPU golden test runs on a machine with an NVIDIA GPU";
  const std::unique_ptr<Device> gpu = Device::cuda(0, Precision::kFp32);
  check_golden(*gpu);
}

TEST(BertGolden, OnTheGpuInTf32WithinItsTolerance) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): the GPU golden test runs on a machine with an NVIDIA GPU";
  check_golden(*Device::cuda(0, Precision::kTf32), kTf32Tolerance);
}

TEST(BertGolden, OnTheGpuInBf16WithinItsTolerance) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): the GPU golden test runs on a machine with an NVIDIA GPU";
  check_golden(*Device::cuda(0, Precision::kBf16), kBf16Tolerance, kBf16GradientTolerance);
}

// The task heads (tests/fixtures/bert_heads_golden.h5, tests/golden/make_heads_golden.py): logits,
// loss and every gradient of BertForSequenceClassification, BertForTokenClassification,
// BertForQuestionAnswering and a one-output BertForSequenceClassification, a regression (scores, MSE).
void check_heads_golden(const Device& device, double head_tolerance = kGoldenTolerance,
                        double regression_tolerance = kGoldenTolerance) {
  const std::string path = testing::fixtures_dir() + "/bert_heads_golden.h5";
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0) << "missing fixture " << path;
  for (const std::string head : {"seq_cls", "token_cls", "qa", "seq_reg"}) {
    SCOPED_TRACE(head);
    hid_t group = H5Gopen2(f, head.c_str(), H5P_DEFAULT);
    Bert model(BertConfig::from_json(Json::parse(read_string_attribute(group, "config"))));
    ASSERT_EQ(model.config().head, head == "token_cls" ? Head::kTokenClassification
                                   : head == "qa"      ? Head::kQuestionAnswering
                                                       : Head::kSequenceClassification);
    const bool regression = head == "seq_reg";
    ASSERT_EQ(model.config().regression(), regression);
    const double tolerance = regression ? regression_tolerance : head_tolerance;
    ParameterArena<float>& params = model.parameters();
    int model_parameters = 0;
    for (ParamId id = 0; id < params.size(); ++id) {
      if (is_quantizer_scale(params.name(id))) continue;
      ++model_parameters;
      std::vector<float> values = read_all<float>(group, "params/" + params.name(id));
      ASSERT_EQ(static_cast<int64_t>(values.size()), params.get(id).value.numel()) << params.name(id);
      std::copy(values.begin(), values.end(), params.get(id).value.data());
    }
    hsize_t count = 0;
    hid_t pg = H5Gopen2(group, "params", H5P_DEFAULT);
    H5Gget_num_objs(pg, &count);
    H5Gclose(pg);
    EXPECT_EQ(static_cast<int>(count), model_parameters) << "the model has exactly the reference's parameters";

    std::vector<int32_t> ids = read_all<int32_t>(group, "inputs/input_ids"), labels;
    std::vector<float> scores;
    if (regression)
      scores = read_all<float>(group, "inputs/labels");
    else
      labels = read_all<int32_t>(group, "inputs/labels");
    std::vector<int8_t> mask, types;
    for (int32_t v : read_all<int32_t>(group, "inputs/attention_mask")) mask.push_back(static_cast<int8_t>(v));
    for (int32_t v : read_all<int32_t>(group, "inputs/token_type_ids")) types.push_back(static_cast<int8_t>(v));
    const int64_t b = 3, t = 8, n = model.config().num_labels(), layers = model.config().num_hidden_layers;
    BatchView batch{b, t, 0, ids, mask, types, {}, {}, {}, labels, scores};
    model.place_on(device);
    Graph<float> g(device);
    Rng rng(1);
    ModelOutputs out = model.forward(g, batch, /*training=*/true, rng);  // dropout is 0 in this config
    // Our token-classification logits are those of the labeled tokens: pick the reference's rows.
    const std::vector<double> all_logits = read_all<double>(group, "expected/logits");
    std::vector<double> expected_logits;
    std::vector<int32_t> expected_rows;
    if (head == "seq_cls" || regression) {
      expected_logits = all_logits;
      expected_rows = {0, 8, 16};
    } else if (head == "qa") {  // the reference's (B, T, 2) as ours: (2 B, T), each sequence's start row, end row
      for (int64_t i = 0; i < b; ++i)
        for (int64_t part = 0; part < 2; ++part)
          for (int64_t j = 0; j < t; ++j) expected_logits.push_back(all_logits[(i * t + j) * 2 + part]);
      expected_rows = {0, 8, 16};
      EXPECT_EQ(out.targets, labels);
    } else {
      for (int64_t r = 0; r < b * t; ++r)
        if (labels[r] != kIgnoredLabel) {
          expected_rows.push_back(static_cast<int32_t>(r));
          expected_logits.insert(expected_logits.end(), all_logits.begin() + r * n, all_logits.begin() + (r + 1) * n);
        }
    }
    EXPECT_EQ(out.rows, expected_rows);
    EXPECT_LT(relative_error(g.to_host(out.logits), expected_logits), tolerance);
    EXPECT_LT(relative_error(g.to_host(out.loss), read_all<double>(group, "expected/loss")), tolerance);

    g.backward(out.loss);
    params.download_grads();
    // Exactly-zero gradients (the attention key biases) are held to 1e-6 in FP32; in a mixed precision
    // (tolerance above 1e-2) to the tolerance times the largest gradient, as check_golden does.
    double largest = 0;
    for (ParamId id = 0; id < params.size(); ++id)
      if (!is_quantizer_scale(params.name(id)))
        for (double v : read_all<double>(group, "grads/" + params.name(id))) largest = std::max(largest, std::abs(v));
    const double zero_gradient_limit = tolerance > 1e-2 ? tolerance * largest : 1e-6;
    double worst = 0;
    for (ParamId id = 0; id < params.size(); ++id) {
      if (is_quantizer_scale(params.name(id))) continue;
      const std::vector<double> expected = read_all<double>(group, "grads/" + params.name(id));
      TensorView<float> grad = params.get(id).grad;
      double scale = 0, diff = 0;
      for (size_t i = 0; i < expected.size(); ++i) {
        scale = std::max(scale, std::abs(expected[i]));
        diff = std::max(diff, std::abs(double(grad[i]) - expected[i]));
      }
      if (scale < 1e-12) {
        // Exactly zero in the reference: the attention key biases (a softmax ignores what every key adds
        // alike), and for question answering the biases that add the same to every position's logits
        // (qa_outputs' and the last LayerNorm's: the cross-entropy runs over the positions).
        const std::string& name = params.name(id);
        EXPECT_TRUE(
            name.ends_with("attention.self.key.bias") ||
            (head == "qa" && (name == "qa_outputs.bias" ||
                              name == "bert.encoder.layer." + std::to_string(layers - 1) + ".output.LayerNorm.bias")))
            << name;
        EXPECT_LT(diff, zero_gradient_limit) << params.name(id);
        continue;
      }
      EXPECT_LT(diff / scale, tolerance) << params.name(id);
      worst = std::max(worst, diff / scale);
    }
    std::cout << "[ info ] " << device.name() << " " << head << ": largest gradient relative error " << worst << "\n";
    H5Gclose(group);
  }
  H5Fclose(f);
}

TEST(BertGolden, TaskHeadsMatchPyTorch) { check_heads_golden(Device::cpu()); }

TEST(BertGolden, TaskHeadsOnTheGpuInFp32) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): the GPU golden test runs on a machine with an NVIDIA GPU";
  check_heads_golden(*Device::cuda(0, Precision::kFp32));
}

TEST(BertGolden, TaskHeadsOnTheGpuInBf16WithinItsTolerance) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): the GPU golden test runs on a machine with an NVIDIA GPU";
  check_heads_golden(*Device::cuda(0, Precision::kBf16), kGpuBf16HeadsGradientTolerance,
                     kGpuBf16RegressionGradientTolerance);
}

TEST(BertModel, EvaluationWithoutGradientsGivesTheSameLogitsAndRecordsNothing) {
  BertConfig c = preset("tiny");
  c.vocab_size = 50;
  c.max_position_embeddings = 16;
  Bert model(c);
  model.initialize(3);
  std::vector<int32_t> ids{2, 7, 8, 3, 9, 10, 3, 0}, positions{1, 5}, masked{7, 10};
  std::vector<int8_t> mask{1, 1, 1, 1, 1, 1, 1, 0}, types{0, 0, 0, 0, 1, 1, 1, 0}, labels{1};
  BatchView batch{1, 8, 2, ids, mask, types, positions, masked, labels, {}, {}};
  Graph<float> g;
  Rng rng(1);
  std::vector<float> eval_logits;
  {
    NoGradGuard<float> no_grad(g);
    ModelOutputs out = model.forward(g, batch, false, rng);
    EXPECT_EQ(g.num_backward_closures(), 0u);
    eval_logits.assign(g.value(out.mlm_logits).begin(), g.value(out.mlm_logits).end());
    g.clear();
  }
  ModelOutputs out = model.forward(g, batch, false, rng);
  EXPECT_EQ(std::vector<float>(g.value(out.mlm_logits).begin(), g.value(out.mlm_logits).end()), eval_logits);
  // Training mode with dropout changes the output; evaluation mode is deterministic.
  g.clear();
  ModelOutputs train = model.forward(g, batch, true, rng);
  EXPECT_NE(std::vector<float>(g.value(train.mlm_logits).begin(), g.value(train.mlm_logits).end()), eval_logits);
}

// QAT against the reference with the same quantizers (LSQ): logits, losses, every gradient (the scales'
// included) and the saturated values, in FP32 (the quantizers' inputs are at least 1e-4 of a step from a
// rounding boundary, so FP32 and float64 round alike).
TEST(BertGolden, QatStepMatchesPyTorch) {
  for (Golden which : {Golden::kQat, Golden::kQatPerTensorWeights}) {
    SCOPED_TRACE(golden_fixture(which));
    check_golden(Device::cpu(), kGoldenTolerance, 0, which);
  }
}

TEST(BertGolden, QatStepOnTheGpuInFp32MatchesPyTorch) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): the GPU golden test runs on a machine with an NVIDIA GPU";
  for (Golden which : {Golden::kQat, Golden::kQatPerTensorWeights}) {
    SCOPED_TRACE(golden_fixture(which));
    check_golden(*Device::cuda(0, Precision::kFp32), kGoldenTolerance, 0, which);
  }
}

// The quantizers fused into the GELU, dropout and permute ops against each quantizer as an op of its own,
// in QAT training mode (dropout on, every quantizer enabled): the same loss, gradients (scales included)
// and saturation counts. On the CPU the fused ops are the two ops in sequence (this checks the model
// places each quantizer where it was); on a GPU, one kernel each way instead of two.
struct QatStep {
  float loss = 0;
  std::vector<float> grads;
  std::vector<int64_t> clipped, seen;
  std::size_t workspace_bytes = 0;  // what the step's graph held at its peak
};
// The tiny preset over a 60-token vocabulary and 16 positions, every quantizer enabled: activation
// scales 0.03 (some values saturate), weight scales `weight_scale`, or per channel max |w| / 127 (as max
// calibration sets them) when it is 0.
// With WeightScales::kPerTensor, one weight scale: max |w| / 127 over the weight when weight_scale is 0.
std::unique_ptr<Bert> quantized_tiny(float weight_scale, WeightScales weight_scales = WeightScales::kPerChannel) {
  BertConfig c = preset("tiny");
  c.vocab_size = 60;
  c.max_position_embeddings = 16;
  c.weight_scales = weight_scales;
  auto model = std::make_unique<Bert>(c);
  model->initialize(5);
  for (Quantizer* q : model->quantizers()) {
    q->mode = QuantMode::kQuantize;
    TensorView<float> scale = model->parameters().get(q->scale).value;
    if (!q->is_weight || weight_scale > 0) {
      scale.fill(q->is_weight ? weight_scale : 0.03f);
      continue;
    }
    const TensorView<float> w = model->parameters().get(model->quantized_weight(*q)).value;
    const int64_t in = w.numel() / q->channels;
    for (int64_t ch = 0; ch < q->channels; ++ch) {
      float m = 0;
      for (int64_t i = 0; i < in; ++i) m = std::max(m, std::abs(w[ch * in + i]));
      scale[ch] = m / 127;
    }
  }
  return model;
}

// Two sequences of 8 (one padded position), four masked positions: the batch of the step tests below.
struct StepBatch {
  std::vector<int32_t> ids{2, 7, 8, 3, 9, 10, 3, 0, 2, 11, 12, 13, 3, 14, 15, 3}, positions{1, 5, 2, 0},
      masked{7, 10, 12, 0};
  std::vector<int8_t> mask{1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1},
      types{0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1}, labels{1, 0};
  BatchView view() const { return BatchView{2, 8, 2, ids, mask, types, positions, masked, labels, {}, {}}; }
};

// One training step (dropout on) of `model` on `device` over StepBatch: the loss, every gradient and the
// quantizers' saturation counts.
QatStep training_step(Bert& model, const Device& device, bool reuse_gradients = true) {
  model.place_on(device);
  const StepBatch data;
  const BatchView batch = data.view();
  Graph<float> g(device);
  g.set_reuse_gradients(reuse_gradients);
  Rng rng(9);
  ModelOutputs out = model.forward(g, batch, /*training=*/true, rng);
  QatStep r;
  r.loss = g.item(out.loss);
  g.backward(out.loss);
  model.parameters().download_grads();
  model.collect_clip_counts();
  for (ParamId id = 0; id < model.parameters().size(); ++id)
    for (float v : model.parameters().get(id).grad) r.grads.push_back(v);
  for (Quantizer* q : model.quantizers()) r.clipped.push_back(q->clipped), r.seen.push_back(q->seen);
  r.workspace_bytes = g.workspace().peak_bytes_in_use();
  return r;
}

QatStep qat_step(const Device& device, bool fused) {
  std::unique_ptr<Bert> quantized = quantized_tiny(0.0015f);  // some weights saturate too
  quantized->set_fused_quantizers(fused);
  return training_step(*quantized, device);
}

// The same loss and gradients within `tolerance` of the plain step's (relative to the largest gradient).
void expect_same_loss_and_gradients(const QatStep& fused, const QatStep& plain, double tolerance, const char* what) {
  EXPECT_NEAR(fused.loss, plain.loss, tolerance * std::abs(plain.loss));
  ASSERT_EQ(fused.grads.size(), plain.grads.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < plain.grads.size(); ++i) {
    diff = std::max(diff, std::abs(double(fused.grads[i]) - plain.grads[i]));
    scale = std::max(scale, std::abs(double(plain.grads[i])));
  }
  std::cout << "[ info ] " << what << ": loss " << fused.loss << " vs " << plain.loss << ", largest gradient difference "
            << diff / scale << " of the largest gradient\n";
  EXPECT_LE(diff, tolerance * scale);
}

void expect_same_step(const QatStep& fused, const QatStep& plain, double tolerance) {
  expect_same_loss_and_gradients(fused, plain, tolerance, "fused vs separate quantizers");
  EXPECT_EQ(fused.seen, plain.seen);
  int64_t saturated = 0;
  for (int64_t c : plain.clipped) saturated += c;
  EXPECT_GT(saturated, 0) << "the scales are small enough that some values saturate";
}

TEST(BertModel, FusedQuantizersGiveTheSameQatStepAsSeparateOnes) {
  {
    SCOPED_TRACE("cpu");
    const QatStep fused = qat_step(Device::cpu(), true), plain = qat_step(Device::cpu(), false);
    expect_same_step(fused, plain, 0.0);
    EXPECT_EQ(fused.clipped, plain.clipped);
  }
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): the GPU part runs on a machine with an NVIDIA GPU";
  {
    SCOPED_TRACE("gpu fp32");
    std::unique_ptr<Device> gpu = Device::cuda(0, Precision::kFp32);
    const QatStep fused = qat_step(*gpu, true), plain = qat_step(*gpu, false);
    expect_same_step(fused, plain, 1e-5);  // the same arithmetic: only sums may run in another order
    EXPECT_EQ(fused.clipped, plain.clipped);
  }
  {
    // The fused ops quantize the op's FP32 result, the separate ones its BF16 copy: a value within a
    // BF16 rounding of a rounding boundary may land one step apart.
    SCOPED_TRACE("gpu bf16");
    std::unique_ptr<Device> gpu = Device::cuda(0, Precision::kBf16);
    expect_same_step(qat_step(*gpu, true), qat_step(*gpu, false), 5e-2);
  }
}

// QAT's linears on a GPU with their forward products on the integers behind the fake-quantized values
// (Bert::set_integer_training, the default; on an H100 or H200 the int8 tensor cores) against float GEMMs on
// those values: the same step up to float rounding of the products, which now and then moves a later
// quantizer's input across a rounding boundary (a step of that quantizer). Elsewhere the two are the same ops.
TEST(BertModel, IntegerProductsGiveTheQatStepOfFloatProductsOnTheGpu) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): this test runs on a machine with an NVIDIA GPU";
  for (Precision precision : {Precision::kFp32, Precision::kBf16}) {
    SCOPED_TRACE(precision_name(precision));
    std::unique_ptr<Device> gpu = Device::cuda(0, precision);
    auto step = [&](bool integers) {
      std::unique_ptr<Bert> quantized = quantized_tiny(0.0015f);
      quantized->set_integer_training(integers);
      return training_step(*quantized, *gpu);
    };
    const QatStep integers = step(true), floats = step(false);
    expect_same_loss_and_gradients(integers, floats, precision == Precision::kFp32 ? 3e-2 : 5e-2,
                                   "integer vs float products");
    EXPECT_EQ(integers.seen, floats.seen);
  }
}

// backward() hands a node's gradient buffer on once the node's closure has run: the same step (float and
// QAT, fused attention on a GPU) gives the same loss and gradients, bit for bit, in less workspace memory.
void check_reused_gradients(const Device& device, const char* what, bool quantized, bool fused_attention) {
  SCOPED_TRACE(what);
  auto step = [&](bool reuse) {
    std::unique_ptr<Bert> model = quantized_tiny(0.0015f);
    if (!quantized)
      for (Quantizer* q : model->quantizers()) q->mode = QuantMode::kFloat;
    model->set_fused_attention(fused_attention);
    return training_step(*model, device, reuse);
  };
  const QatStep reused = step(true), plain = step(false);
  EXPECT_EQ(reused.loss, plain.loss);
  EXPECT_EQ(reused.grads, plain.grads);
  EXPECT_EQ(reused.clipped, plain.clipped);
  EXPECT_LT(reused.workspace_bytes, plain.workspace_bytes);
  std::cout << "[ info ] " << what << ": workspace " << plain.workspace_bytes << " -> " << reused.workspace_bytes
            << " bytes with gradient buffers reused\n";
}

TEST(BertModel, ReusedGradientBuffersGiveTheSameStepInLessMemory) {
  check_reused_gradients(Device::cpu(), "cpu float", false, false);
  check_reused_gradients(Device::cpu(), "cpu qat", true, false);
}

TEST(BertModel, ReusedGradientBuffersGiveTheSameStepInLessMemoryOnTheGpu) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): the GPU part runs on a machine with an NVIDIA GPU";
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    std::unique_ptr<Device> gpu = Device::cuda(0, p);
    const bool bf16 = p == Precision::kBf16;
    check_reused_gradients(*gpu, bf16 ? "gpu bf16 float" : "gpu fp32 float", false, false);
    check_reused_gradients(*gpu, bf16 ? "gpu bf16 qat" : "gpu fp32 qat", true, false);
    check_reused_gradients(*gpu, bf16 ? "gpu bf16 fused attention" : "gpu fp32 fused attention", false, true);
    check_reused_gradients(*gpu, bf16 ? "gpu bf16 qat, fused attention" : "gpu fp32 qat, fused attention", true, true);
  }
}

// A training step (dropout on) of a tiny float model, its attention set up by `set`.
QatStep tiny_float_step(const Device& device, const std::function<void(Bert&)>& set) {
  BertConfig c = preset("tiny");
  c.vocab_size = 60;
  c.max_position_embeddings = 16;
  Bert model(c);
  model.initialize(5);
  set(model);
  return training_step(model, device);
}

// A training step (dropout on) with the fused attention against the unfused ops, on a GPU: the same
// dropout draws, so the loss and every gradient agree up to float summation order (BF16: its rounding).
QatStep float_step(const Device& device, bool fused_attention) {
  EXPECT_TRUE(ops::fused_attention(Graph<float>(device), preset("tiny").head_size(), 8));
  return tiny_float_step(device, [&](Bert& model) { model.set_fused_attention(fused_attention); });
}

TEST(BertModel, FusedAttentionGivesTheUnfusedTrainingStep) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): the fused attention runs on a machine with an NVIDIA GPU";
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    SCOPED_TRACE(p == Precision::kFp32 ? "fp32" : "bf16");
    std::unique_ptr<Device> gpu = Device::cuda(0, p);
    expect_same_loss_and_gradients(float_step(*gpu, true), float_step(*gpu, false),
                                   p == Precision::kFp32 ? 1e-5 : 5e-2, "fused vs unfused attention");
  }
}

// A QAT step (every quantizer on, dropout on) with the fused attention against the unfused ops: in BF16 Q,
// K and V fake-quantized before the fused kernels and the probabilities' quantizer inside them, the same
// dropout draws, so the loss and every gradient (the quantizers' scales too) agree up to BF16 rounding; in
// FP32 the fused kernels leave QAT to the ops (the same step).
TEST(BertModel, FusedAttentionGivesTheUnfusedQatStep) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): the fused attention runs on a machine with an NVIDIA GPU";
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    SCOPED_TRACE(p == Precision::kFp32 ? "fp32" : "bf16");
    std::unique_ptr<Device> gpu = Device::cuda(0, p);
    EXPECT_EQ(ops::fused_quantized_attention(Graph<float>(*gpu), preset("tiny").head_size(), 8), p == Precision::kBf16);
    auto step = [&](bool fused_attention) {
      std::unique_ptr<Bert> model = quantized_tiny(0.0015f);
      model->set_fused_attention(fused_attention);
      return training_step(*model, *gpu);
    };
    expect_same_loss_and_gradients(step(true), step(false), p == Precision::kFp32 ? 1e-5 : 5e-2,
                                   "qat, fused vs unfused attention");
  }
}

// The unfused attention with its scores and probabilities computed again in the backward (bert-train
// --attention recompute): the kept step's loss and gradients bit for bit (the same dropout draws), on the CPU
// with less kept in the step's workspace. On a GPU the kept step's scores are transient already (ops::
// head_scores), so at this model's length of 8 it keeps about what the recomputation's own bookkeeping takes;
// CudaOps.RecomputedAttentionCoreEqualsTheKeptOps holds the sizes at a length where they count. A BF16 step
// keeps them either way (F32 activations only).
QatStep recompute_step(const Device& device, bool recompute) {
  return tiny_float_step(device, [&](Bert& model) { model.set_recompute_attention(recompute); });
}

TEST(BertModel, RecomputedAttentionGivesTheKeptStepInLessMemory) {
  std::vector<std::unique_ptr<Device>> gpus;
  if (Device::cuda_available()) {
    gpus.push_back(Device::cuda(0, Precision::kFp32));
    gpus.push_back(Device::cuda(0, Precision::kBf16));
  }
  std::vector<const Device*> devices = {&Device::cpu()};
  for (const auto& gpu : gpus) devices.push_back(gpu.get());
  for (const Device* device : devices) {
    const bool bf16 = device->is_cuda() && device->precision() == Precision::kBf16;
    SCOPED_TRACE(device->name());
    const QatStep again = recompute_step(*device, true), kept = recompute_step(*device, false);
    EXPECT_EQ(again.loss, kept.loss);
    EXPECT_EQ(again.grads, kept.grads);
    if (bf16) {
      EXPECT_EQ(again.workspace_bytes, kept.workspace_bytes);
    } else if (!device->is_cuda()) {
      EXPECT_LT(again.workspace_bytes, kept.workspace_bytes);
    }
    std::cout << "[ info ] " << device->name() << ": workspace " << kept.workspace_bytes << " -> "
              << again.workspace_bytes << " bytes with the attention recomputed\n";
  }
  if (gpus.empty()) GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): the CPU part ran";
}

// The largest |actual - expected| over the largest |expected|.
double largest_relative_difference(const std::vector<float>& actual, const std::vector<float>& expected) {
  EXPECT_EQ(actual.size(), expected.size());
  double diff = 0, largest = 0;
  for (size_t i = 0; i < expected.size() && i < actual.size(); ++i) {
    diff = std::max(diff, std::abs(double(actual[i]) - expected[i]));
    largest = std::max(largest, std::abs(double(expected[i])));
  }
  return largest > 0 ? diff / largest : diff;
}

// Logits of one evaluation batch (MLM then NSP), with or without the graph recording gradients.
std::vector<float> eval_logits(Bert& model, bool record_gradients, const Device& device = Device::cpu()) {
  std::vector<int32_t> ids(4 * 16), positions{1, 5, 2, 9, 3, 0, 4, 7};
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = 5 + static_cast<int32_t>((i * 37) % 55);
  std::vector<int32_t> masked(positions.size(), 8);
  std::vector<int8_t> mask(ids.size(), 1), types(ids.size(), 0), labels(4, 0);
  BatchView batch{4, 16, 2, ids, mask, types, positions, masked, labels, {}, {}};
  Graph<float> g(device);
  std::unique_ptr<NoGradGuard<float>> no_grad = record_gradients ? nullptr : std::make_unique<NoGradGuard<float>>(g);
  Rng rng(3);
  ModelOutputs out = model.forward(g, batch, /*training=*/false, rng);
  std::vector<float> logits = g.to_host(out.mlm_logits);
  for (float v : g.to_host(out.nsp_logits)) logits.push_back(v);
  return logits;
}

// Evaluation's MLM loss and top predictions made without the decoder's logits (MlmOutputs::kLossAndPredictions)
// are those the logits give (the loss up to summation order), for the float model, the integer encoder and
// the integer decoder; with gradients recorded the logits are made and the predictions read off them.
TEST(BertModel, LossAndPredictionsWithoutLogitsAreTheLogitsOnes) {
  std::unique_ptr<Bert> quantized = quantized_tiny(0);
  Bert& model = *quantized;
  std::vector<int32_t> ids(4 * 16), positions{1, 5, 2, 9, 3, 0, 4, 7};
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = 5 + static_cast<int32_t>((i * 37) % 55);
  const std::vector<int32_t> masked{8, 9, 10, 11, 12, 13, 14, 15};
  std::vector<int8_t> mask(ids.size(), 1), types(ids.size(), 0), labels(4, 0);
  const BatchView batch{4, 16, 2, ids, mask, types, positions, masked, labels, {}, {}};
  for (int integer : {0, 1, 2}) {  // float, integer encoder, integer encoder and decoder
    SCOPED_TRACE("integer " + std::to_string(integer));
    if (integer > 0) model.prepare_integer_inference(/*integer_decoder=*/integer == 2);
    for (bool record_gradients : {false, true}) {
      Graph<float> g;
      std::unique_ptr<NoGradGuard<float>> no_grad =
          record_gradients ? nullptr : std::make_unique<NoGradGuard<float>>(g);
      Rng rng(3);
      const ModelOutputs logits = model.forward(g, batch, false, rng);
      const float loss = g.item(logits.mlm_loss);
      const std::vector<int32_t> predicted = ops::row_argmax(g, logits.mlm_logits);
      const ModelOutputs scored = model.forward(g, batch, false, rng, MlmOutputs::kLossAndPredictions);
      EXPECT_EQ(scored.mlm_logits.valid(), record_gradients);  // no logits where evaluation runs without gradients
      EXPECT_NEAR(g.item(scored.mlm_loss), loss, 1e-5 * loss);
      ASSERT_EQ(predicted.size(), 7u);  // the real masked positions
      EXPECT_EQ(scored.mlm_predictions, predicted);
      EXPECT_TRUE(logits.mlm_predictions.empty());
    }
  }
  model.clear_integer_inference();
}

TEST(BertModel, IntegerInferenceGivesTheFakeQuantizedModelsLogits) {
  std::unique_ptr<Bert> quantized = quantized_tiny(0);  // weight scales as max calibration sets them
  Bert& model = *quantized;
  const BertConfig& c = model.config();
  // Activation scales apart from each other, as calibration gives them: with one scale everywhere (0.03),
  // products of quantized values land exactly on half steps of the next quantizer, where the float
  // summation order alone decides the rounding.
  int index = 0;
  for (Quantizer* q : model.quantizers())
    if (!q->is_weight) model.parameters().get(q->scale).value.fill(0.03f * (1.0f + 0.0137f * float(index++)));
  const std::vector<float> fake = eval_logits(model, false);
  // Recording gradients (training, QAT) the linears sum the fake-quantized floats; in inference they sum
  // the integers behind them exactly (Linear::exact_sums): float rounding apart, and bit for bit the same
  // with the exact sums off.
  const std::vector<float> recorded = eval_logits(model, true);
  EXPECT_LE(largest_relative_difference(recorded, fake), 1e-3);
  model.set_exact_sums(false);
  EXPECT_EQ(eval_logits(model, false), recorded);
  model.set_exact_sums(true);
  EXPECT_EQ(model.prepare_integer_inference(), 6 * c.num_hidden_layers + 2);  // + pooler and MLM transform
  EXPECT_EQ(model.device_int8_gemm(), "");                                    // the CPU's integer kernels
  EXPECT_EQ(model.integer_attention_layers(), c.num_hidden_layers);           // Q K^T and probs V as integers too
  const std::vector<float> integer = eval_logits(model, false);
  ASSERT_EQ(integer.size(), fake.size());
  // The linears sum the same integers exactly on both sides; the attention products are float products of
  // fake-quantized values on one side and integer sums on the other: differences at float rounding at most,
  // except where such a difference moves a later activation across a rounding boundary (one quantization
  // step there). On this model every logit is bit-identical.
  double diff = 0, largest = 0;
  int64_t equal = 0;
  for (size_t i = 0; i < fake.size(); ++i) {
    diff = std::max(diff, std::abs(double(integer[i]) - fake[i]));
    largest = std::max(largest, std::abs(double(fake[i])));
    equal += integer[i] == fake[i];
  }
  std::cout << "[ info ] integer vs fake-quantized logits: largest difference " << diff / largest
            << " of the largest logit; " << equal << " of " << fake.size() << " bit-identical\n";
  EXPECT_LE(diff, 1e-3 * largest);
  // The integer layers run on their packed copy: changing the float weights afterwards leaves their
  // output alone (and shows the integer path ran), until prepared again.
  TensorView<float> w = model.parameters().get("bert.encoder.layer.0.attention.self.value.weight").value;
  const std::vector<float> saved(w.begin(), w.end());
  for (float& v : w) v *= 2;
  EXPECT_EQ(eval_logits(model, false), integer);
  EXPECT_NE(eval_logits(model, true), recorded);
  std::copy(saved.begin(), saved.end(), w.begin());
  // Recording gradients (training, QAT) and after clearing: the float path, bit for bit.
  EXPECT_EQ(eval_logits(model, true), recorded);
  model.clear_integer_inference();
  EXPECT_EQ(eval_logits(model, false), fake);
  // Only layers with both quantizers enabled become integer.
  EXPECT_EQ(model.integer_attention_layers(), 0);
  // The shared input quantizer of Q, K and V in float: all three stay float.
  model.find_quantizer("bert.encoder.layer.0.attention.self.input_quantizer")->mode = QuantMode::kFloat;
  EXPECT_EQ(model.prepare_integer_inference(), 6 * c.num_hidden_layers - 1);
  // The attention products only where all four of their quantizers are enabled.
  model.find_quantizer("bert.encoder.layer.0.attention.self.matmul_a_input_quantizer")->mode = QuantMode::kFloat;
  model.prepare_integer_inference();
  EXPECT_EQ(model.integer_attention_layers(), c.num_hidden_layers - 1);
}

// INT8 inference on the GPU: the linear layers as int8 tensor-core GEMMs (the CPU engine's values), with
// the attention products fake-quantized in float (integer_attention off). The fake-quantized model on the
// GPU sums its linears' integers exactly in inference too (BF16 tensor cores on integer operands), so the
// two give the same logits bit for bit; the CPU's fake-quantized model gives them up to the float ops that
// differ between CPU and GPU (erf, exp: an ulp), each such difference moving an activation across a
// quantizer's rounding boundary at most (one step there). With the attention products as integers too
// (the default: ops::int8_attention_integers), the CPU integer engine's logits and the fake-quantized
// model's up to such steps. The integer copy of the weights is what runs; recording gradients, and after
// clearing, the float path. The same in BF16 mixed precision.
TEST(BertModel, IntegerInferenceOnTheGpuGivesTheFakeQuantizedLogits) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): this test runs on a machine with an NVIDIA GPU";
  const std::unique_ptr<Device> gpu = Device::cuda(0, Precision::kFp32);
  std::unique_ptr<Bert> on_cpu = quantized_tiny(0), on_gpu = quantized_tiny(0);
  for (Bert* model : {on_cpu.get(), on_gpu.get()}) {
    int index = 0;  // distinct activation scales, as in the CPU integer-inference test above
    for (Quantizer* q : model->quantizers())
      if (!q->is_weight) model->parameters().get(q->scale).value.fill(0.03f * (1.0f + 0.0137f * float(index++)));
  }
  on_gpu->place_on(*gpu);
  Bert& model = *on_gpu;
  const BertConfig& c = model.config();
  const std::vector<float> cpu_fake = eval_logits(*on_cpu, false);  // exact sums, attention products in float
  const std::vector<float> fake = eval_logits(model, false, *gpu), recorded = eval_logits(model, true, *gpu);
  EXPECT_THROW(model.prepare_integer_inference(/*integer_decoder=*/true), UserError);  // the decoder: CPU only
  EXPECT_EQ(model.prepare_integer_inference(false, true, /*integer_attention=*/false), 6 * c.num_hidden_layers + 2);
  // The GEMM bert-eval names: ours on Hopper (H100, H200: this build has sm_90a code), else cuBLASLt's.
  const bool hopper = gpu->name().find("H100") != std::string::npos || gpu->name().find("H200") != std::string::npos;
  EXPECT_EQ(model.device_int8_gemm(),
            hopper ? "wgmma int8 GEMM with the dequantization in its epilogue" : "cuBLASLt int8 tensor-core GEMM");
  EXPECT_EQ(model.integer_attention_layers(), 0);                   // the products fake-quantized in float
  EXPECT_EQ(model.fused_projection_layers(), c.num_hidden_layers);  // Q, K, V as one integer linear
  EXPECT_EQ(eval_logits(model, false, *gpu), fake);
  // Both residual LayerNorms of each layer read the int8 integers of the sublayer's output and of the
  // residual (an INT8 residual stream); with the quantizers one by one, none does.
  EXPECT_EQ(model.integer_residual_norms(), 2 * c.num_hidden_layers);
  model.set_fused_quantizers(false);
  EXPECT_LE(largest_relative_difference(eval_logits(model, false, *gpu), fake), 1e-3);
  EXPECT_EQ(model.integer_residual_norms(), 0);
  model.set_fused_quantizers(true);
  // The projections one by one: the same logits.
  model.prepare_integer_inference(/*integer_decoder=*/false, /*fuse_projections=*/false, false);
  EXPECT_EQ(model.fused_projection_layers(), 0);
  EXPECT_EQ(eval_logits(model, false, *gpu), fake);
  // The attention products as integers too.
  model.prepare_integer_inference();
  EXPECT_EQ(model.integer_attention_layers(), c.num_hidden_layers);
  const std::vector<float> integer = eval_logits(model, false, *gpu);
  const double fake_difference = largest_relative_difference(integer, fake);
  on_cpu->prepare_integer_inference();
  const double engine_difference = largest_relative_difference(integer, eval_logits(*on_cpu, false));
  on_cpu->clear_integer_inference();
  std::cout << "[ info ] GPU integer attention vs the fake-quantized logits: largest difference " << fake_difference
            << ", vs the CPU integer engine: " << engine_difference << " of the largest logit\n";
  EXPECT_LE(fake_difference, 1e-3);
  EXPECT_LE(engine_difference, 2e-2);  // (the CPU's erf and exp apart, as the float paths below)
  // The projections one by one leave the products fake-quantized (the kernel reads the fused linear's integers).
  model.prepare_integer_inference(/*integer_decoder=*/false, /*fuse_projections=*/false);
  EXPECT_EQ(model.integer_attention_layers(), 0);
  EXPECT_EQ(eval_logits(model, false, *gpu), fake);
  model.prepare_integer_inference();
  const double cpu_difference = largest_relative_difference(integer, cpu_fake);
  std::cout << "[ info ] GPU integer vs CPU fake-quantized logits: largest difference " << cpu_difference
            << " of the largest logit\n";
  EXPECT_LE(cpu_difference, 2e-2);
  model.set_exact_sums(false);  // the GPU's fake-quantized model summing floats: float rounding apart
  EXPECT_LE(largest_relative_difference(eval_logits(model, false, *gpu), integer), 2e-2);
  model.set_exact_sums(true);
  // The integer layers run on their device copy: doubling the float weights moves the float path only.
  TensorView<float> w = model.parameters().get("bert.encoder.layer.0.output.dense.weight").value;
  for (float& v : w) v *= 2;
  model.parameters().upload_values();
  EXPECT_EQ(eval_logits(model, false, *gpu), integer);
  EXPECT_NE(eval_logits(model, true, *gpu), recorded);
  for (float& v : w) v /= 2;
  model.parameters().upload_values();
  EXPECT_EQ(eval_logits(model, true, *gpu), recorded);
  model.clear_integer_inference();
  EXPECT_EQ(eval_logits(model, false, *gpu), fake);
  // BF16 activations: the integer layers' inputs quantized by their producers as in the fake-quantized model
  // (Linear::used_input_quantizer), the integer linears recovering those integers: the same logits again.
  const std::unique_ptr<Device> gpu_bf16 = Device::cuda(0, Precision::kBf16);
  std::unique_ptr<Bert> in_bf16 = quantized_tiny(0);
  int index = 0;
  for (Quantizer* q : in_bf16->quantizers())
    if (!q->is_weight) in_bf16->parameters().get(q->scale).value.fill(0.03f * (1.0f + 0.0137f * float(index++)));
  in_bf16->place_on(*gpu_bf16);
  const std::vector<float> fake_bf16 = eval_logits(*in_bf16, false, *gpu_bf16);
  in_bf16->prepare_integer_inference(false, true, /*integer_attention=*/false);
  EXPECT_EQ(eval_logits(*in_bf16, false, *gpu_bf16), fake_bf16);
  EXPECT_EQ(in_bf16->integer_residual_norms(), 2 * c.num_hidden_layers);
  in_bf16->prepare_integer_inference(/*integer_decoder=*/false, /*fuse_projections=*/false);
  EXPECT_EQ(eval_logits(*in_bf16, false, *gpu_bf16), fake_bf16);
  // Integer attention in BF16: the scores and probabilities rounded to BF16 as the fake-quantized model
  // stores them, whose products sum exactly in inference (ops::exact_quantized_attention); without the exact
  // sums, it multiplies BF16 roundings of the quantized values.
  in_bf16->prepare_integer_inference();
  EXPECT_EQ(in_bf16->integer_attention_layers(), c.num_hidden_layers);
  const std::vector<float> integer_bf16 = eval_logits(*in_bf16, false, *gpu_bf16);
  const double bf16_difference = largest_relative_difference(integer_bf16, fake_bf16);
  in_bf16->clear_integer_inference();
  in_bf16->set_exact_sums(false);
  const double rounded_difference = largest_relative_difference(integer_bf16, eval_logits(*in_bf16, false, *gpu_bf16));
  std::cout << "[ info ] BF16: GPU integer attention vs the fake-quantized logits: largest difference "
            << bf16_difference << " of the largest logit (" << rounded_difference << " without exact sums)\n";
  EXPECT_LE(bf16_difference, 1e-3);
  EXPECT_LE(rounded_difference, 5e-2);
}

// The MLM decoder as integers too (opt-in; no quantizer of the model covers it): its logits are the float
// decoder's up to per-row quantization of its input and of the word embeddings, the NSP logits are those
// of the integer encoder alone, and training still sees the float model.
TEST(BertModel, IntegerDecoderStaysNearTheFloatDecoder) {
  std::unique_ptr<Bert> quantized = quantized_tiny(0);
  Bert& model = *quantized;
  const BertConfig& c = model.config();
  const std::vector<float> fake = eval_logits(model, false), recorded = eval_logits(model, true);
  ASSERT_EQ(model.prepare_integer_inference(), 6 * c.num_hidden_layers + 2);
  EXPECT_FALSE(model.integer_decoder());
  const std::vector<float> encoder_only = eval_logits(model, false);
  EXPECT_EQ(model.prepare_integer_inference(/*integer_decoder=*/true), 6 * c.num_hidden_layers + 3);
  EXPECT_TRUE(model.integer_decoder());
  const std::vector<float> with_decoder = eval_logits(model, false);
  ASSERT_EQ(with_decoder.size(), encoder_only.size());
  const size_t mlm = with_decoder.size() - 2 * 4;  // the NSP logits (4 x 2) come last
  double diff = 0, largest = 0;
  for (size_t i = 0; i < mlm; ++i) {
    diff = std::max(diff, std::abs(double(with_decoder[i]) - encoder_only[i]));
    largest = std::max(largest, std::abs(double(encoder_only[i])));
  }
  std::cout << "[ info ] integer vs float decoder logits: largest difference " << diff / largest
            << " of the largest logit\n";
  // Two 8-bit roundings in a dot product over the hidden size: below a percent of the largest logit, not zero.
  EXPECT_GT(diff, 0.0);
  EXPECT_LE(diff, 1e-2 * largest);
  for (size_t i = mlm; i < with_decoder.size(); ++i) EXPECT_EQ(with_decoder[i], encoder_only[i]) << "NSP logit " << i;
  EXPECT_EQ(eval_logits(model, true), recorded);  // recording gradients: the float model
  model.clear_integer_inference();
  EXPECT_FALSE(model.integer_decoder());
  EXPECT_EQ(eval_logits(model, false), fake);
}

// Q, K and V read one tensor through one input quantizer: the three projections run as one integer linear
// with x quantized once, and the logits are bit for bit those of three separate integer linears.
TEST(BertModel, FusedIntegerProjectionsGiveTheSeparateProjectionsLogits) {
  std::unique_ptr<Bert> quantized = quantized_tiny(0);
  Bert& model = *quantized;
  const BertConfig& c = model.config();
  int index = 0;  // distinct activation scales, as in the integer-inference test above
  for (Quantizer* q : model.quantizers())
    if (!q->is_weight) model.parameters().get(q->scale).value.fill(0.03f * (1.0f + 0.0137f * float(index++)));
  model.prepare_integer_inference(false, /*fuse_projections=*/false);
  EXPECT_EQ(model.fused_projection_layers(), 0);
  const std::vector<float> separate = eval_logits(model, false);
  model.prepare_integer_inference();
  EXPECT_EQ(model.fused_projection_layers(), c.num_hidden_layers);
  const std::vector<float> fused = eval_logits(model, false);
  EXPECT_EQ(fused, separate);
  // The fused weights are a packed copy too: doubling the float key weights leaves the output alone.
  TensorView<float> w = model.parameters().get("bert.encoder.layer.0.attention.self.key.weight").value;
  for (float& v : w) v *= 2;
  EXPECT_EQ(eval_logits(model, false), separate);
  for (float& v : w) v /= 2;
  // One projection's weight kept in float (a plan): that layer runs the other two as integer linears on x
  // as the shared quantizer gives it, the float one on the same x.
  model.find_quantizer("bert.encoder.layer.0.attention.self.key.weight_quantizer")->mode = QuantMode::kFloat;
  const std::vector<float> fake = eval_logits(model, true);  // recording gradients: the fake-quantized model
  model.prepare_integer_inference();
  EXPECT_EQ(model.fused_projection_layers(), c.num_hidden_layers - 1);
  EXPECT_EQ(model.integer_attention_layers(), c.num_hidden_layers);
  EXPECT_LE(largest_relative_difference(eval_logits(model, false), fake), 1e-3);
  model.clear_integer_inference();
  EXPECT_EQ(model.fused_projection_layers(), 0);
}

// Per-tensor weight scales: one scale a weight, applied as a per-channel model with that scale in every
// channel (logits and weight gradients bit for bit; the scale's gradient the channels' sum, with LSQ's
// gradient scale over the whole weight instead of a row), and the integer engine gives the fake-quantized
// model's logits.
TEST(BertModel, PerTensorWeightScalesActAsOneScaleInEveryChannel) {
  std::unique_ptr<Bert> per_tensor = quantized_tiny(0, WeightScales::kPerTensor);
  int weights = 0;
  for (Quantizer* q : per_tensor->quantizers()) {
    EXPECT_EQ(per_tensor->parameters().shape(q->scale).numel(), 1) << q->name;
    weights += q->is_weight;
  }
  EXPECT_EQ(weights, 6 * 2 + 2);  // six linears a layer, the pooler and the MLM transform
  const TensorView<float> w0 =
      per_tensor->parameters().get("bert.encoder.layer.0.intermediate.dense.weight").value;
  float largest = 0;
  for (float v : w0) largest = std::max(largest, std::abs(v));
  EXPECT_EQ(per_tensor->parameters().get("bert.encoder.layer.0.intermediate.dense.weight_quantizer.scale").value[0],
            largest / 127);
  // The same model per channel, each channel at the weight's one scale.
  std::unique_ptr<Bert> per_channel = quantized_tiny(0);
  for (Quantizer* q : per_channel->quantizers()) {
    const float one = per_tensor->parameters().get(q->scale).value[0];
    per_channel->parameters().get(q->scale).value.fill(one);
  }
  for (Bert* m : {per_tensor.get(), per_channel.get()}) {
    int index = 0;  // distinct activation scales, as calibration gives them
    for (Quantizer* q : m->quantizers())
      if (!q->is_weight) m->parameters().get(q->scale).value.fill(0.03f * (1.0f + 0.0137f * float(index++)));
  }
  const std::vector<float> fake = eval_logits(*per_tensor, true);
  EXPECT_EQ(fake, eval_logits(*per_channel, true));

  auto gradients = [](Bert& m) {
    std::vector<int32_t> ids{2, 7, 8, 3, 9, 10, 3, 0, 2, 11, 12, 13, 3, 14, 15, 3}, positions{1, 5, 2, 0},
        masked{7, 10, 12, 0};
    std::vector<int8_t> mask(16, 1), types(16, 0), labels{1, 0};
    BatchView batch{2, 8, 2, ids, mask, types, positions, masked, labels, {}, {}};
    Graph<float> g;
    Rng rng(9);
    ModelOutputs out = m.forward(g, batch, /*training=*/false, rng);
    m.parameters().zero_grad();
    g.backward(out.loss);
  };
  gradients(*per_tensor);
  gradients(*per_channel);
  const std::string linear = "bert.encoder.layer.1.attention.output.dense";
  const TensorView<float> gw_t = per_tensor->parameters().get(linear + ".weight").grad;
  const TensorView<float> gw_c = per_channel->parameters().get(linear + ".weight").grad;
  EXPECT_EQ(std::vector<float>(gw_t.begin(), gw_t.end()), std::vector<float>(gw_c.begin(), gw_c.end()));
  const TensorView<float> gs_c = per_channel->parameters().get(linear + ".weight_quantizer.scale").grad;
  double channels_sum = 0;
  for (float v : gs_c) channels_sum += v;
  const double out = static_cast<double>(gs_c.numel());
  const float gs_t = per_tensor->parameters().get(linear + ".weight_quantizer.scale").grad[0];
  EXPECT_NE(gs_t, 0.0f);
  EXPECT_NEAR(gs_t, channels_sum / std::sqrt(out), 1e-5 * std::abs(channels_sum));

  // The integer engine, one scale repeated over the channels of each packed weight.
  Bert& model = *per_tensor;
  const BertConfig& c = model.config();
  EXPECT_EQ(model.prepare_integer_inference(), 6 * c.num_hidden_layers + 2);
  EXPECT_EQ(model.fused_projection_layers(), c.num_hidden_layers);
  EXPECT_LE(largest_relative_difference(eval_logits(model, false), fake), 1e-3);
  model.clear_integer_inference();
}

TEST(BertModel, InitializationFollowsBert) {
  BertConfig c = preset("tiny");
  c.vocab_size = 100;
  Bert model(c);
  model.initialize(7);
  ParameterArena<float>& p = model.parameters();
  for (float v : p.get("bert.encoder.layer.1.output.LayerNorm.weight").value) EXPECT_EQ(v, 1.0f);
  for (float v : p.get("bert.encoder.layer.1.output.LayerNorm.bias").value) EXPECT_EQ(v, 0.0f);
  for (float v : p.get("cls.predictions.bias").value) EXPECT_EQ(v, 0.0f);
  TensorView<float> words = p.get("bert.embeddings.word_embeddings.weight").value;
  for (int64_t j = 0; j < c.hidden_size; ++j) EXPECT_EQ(words[j], 0.0f) << "[PAD]'s embedding is zero";
  double s2 = 0;
  int64_t n = 0;
  for (int64_t i = c.hidden_size; i < words.numel(); ++i, ++n) s2 += double(words[i]) * words[i];
  EXPECT_NEAR(std::sqrt(s2 / n), 0.02, 0.001);
  int decaying = 0;
  for (ParamId id = 0; id < p.size(); ++id) {
    const bool expected = !p.name(id).ends_with(".bias") && p.name(id).find("LayerNorm") == std::string::npos &&
                          !p.name(id).ends_with("_quantizer.scale");
    EXPECT_EQ(model.decays(id), expected) << p.name(id);
    decaying += expected;
  }
  EXPECT_EQ(decaying, 3 + 2 * 6 + 3);  // 3 embeddings, 6 linear weights per layer, pooler + transform + NSP
}

// The self-attention's Q, K and V weights lie side by side in the arena, then their biases (the layout
// ops::self_attention reads in place on a GPU), and initialisation still draws them as when each projection's
// weight, bias and scale were declared in turn: the normals after the three embeddings' go to layer 0's
// query, key and value weights, in that order.
TEST(BertModel, ProjectionWeightsLieSideBySideAndDrawTheirFormerValues) {
  BertConfig c = preset("tiny");
  c.vocab_size = 100;
  Bert model(c);
  model.initialize(7);
  ParameterArena<float>& p = model.parameters();
  const int64_t h = c.hidden_size;
  const std::string self = "bert.encoder.layer.0.attention.self.";
  const ParamId query = p.id(self + "query.weight"), query_bias = p.id(self + "query.bias");
  EXPECT_EQ(p.offset(p.id(self + "key.weight")), p.offset(query) + h * h);
  EXPECT_EQ(p.offset(p.id(self + "value.weight")), p.offset(query) + 2 * h * h);
  EXPECT_EQ(p.offset(p.id(self + "key.bias")), p.offset(query_bias) + h);
  EXPECT_EQ(p.offset(p.id(self + "value.bias")), p.offset(query_bias) + 2 * h);
  Rng rng(7);
  rng.reserve(2 * (c.vocab_size + c.max_position_embeddings + c.type_vocab_size) * h);  // two draws a normal
  for (const char* name : {"query", "key", "value"}) {
    const TensorView<float> w = p.get(self + name + ".weight").value;
    int64_t differing = 0;
    for (int64_t i = 0; i < w.numel(); ++i)
      differing += w[i] != static_cast<float>(c.initializer_range * rng.next_normal());
    EXPECT_EQ(differing, 0) << name;
  }
}

TEST(BertModel, QuantizerRegistryFindsEnablesAndMapsWeights) {
  Bert m(preset("tiny"));
  EXPECT_TRUE(m.enabled_quantizers().empty());
  Quantizer* w = m.find_quantizer("bert.encoder.layer.1.intermediate.dense.weight_quantizer");
  Quantizer* a = m.find_quantizer("bert.encoder.layer.0.attention.self.matmul_a_input_quantizer");
  ASSERT_TRUE(w && a);
  EXPECT_EQ(m.find_quantizer("bert.encoder.layer.9.nothing"), nullptr);
  a->mode = w->mode = QuantMode::kQuantize;
  // Forward order: layer 0's attention before layer 1's FFN.
  EXPECT_EQ(m.enabled_quantizer_names(), (std::vector<std::string>{a->name, w->name}));
  EXPECT_EQ(m.parameters().name(m.quantized_weight(*w)), "bert.encoder.layer.1.intermediate.dense.weight");
  EXPECT_THROW(m.quantized_weight(*a), InternalError);
}

TEST(BertConfig, JsonRoundTripPresetsAndValidation) {
  BertConfig mini = preset("mini");
  EXPECT_EQ(mini.num_hidden_layers, 4);
  EXPECT_EQ(mini.hidden_size, 256);
  EXPECT_EQ(mini.num_attention_heads, 4);
  EXPECT_EQ(mini.intermediate_size, 1024);
  EXPECT_EQ(preset("base").num_attention_heads, 12);
  const BertConfig large = preset("large");  // BERT-large: L24 / H1024 / A16, FFN 4096
  EXPECT_EQ(large.num_hidden_layers, 24);
  EXPECT_EQ(large.hidden_size, 1024);
  EXPECT_EQ(large.num_attention_heads, 16);
  EXPECT_EQ(large.intermediate_size, 4096);
  EXPECT_EQ(preset("tiny").num_attention_heads, 2);
  EXPECT_THROW(preset("huge"), UserError);
  BertConfig back = BertConfig::from_json(Json::parse(mini.to_json().dump()));
  EXPECT_EQ(back.to_json().dump(), mini.to_json().dump());

  // A Hugging Face config.json, with fields we do not use.
  BertConfig hf = BertConfig::from_json(Json::parse(R"({"architectures": ["BertForMaskedLM"], "hidden_size": 768,
      "num_attention_heads": 12, "num_hidden_layers": 12, "intermediate_size": 3072, "vocab_size": 30522,
      "layer_norm_eps": 1e-12, "position_embedding_type": "absolute", "transformers_version": "4.30.0"})"));
  EXPECT_EQ(hf.vocab_size, 30522);

  auto error_of = [](const std::string& json) {
    try {
      BertConfig::from_json(Json::parse(json));
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of(R"({"hidden_size": 100, "num_attention_heads": 3})"),
            "invalid model config: hidden_size 100 is not divisible by num_attention_heads 3");
  EXPECT_EQ(error_of(R"({"hidden_act": "relu"})"),
            "invalid model config: hidden_act 'relu' is not supported (only 'gelu', the erf form)");
  EXPECT_EQ(error_of(R"({"hidden_size": "big"})"), "model config field 'hidden_size' must be a number");
  EXPECT_EQ(error_of(R"({"num_hidden_layers": 2.5})"), "model config field 'num_hidden_layers' must be an integer");
  EXPECT_NE(error_of(R"({"hidden_dropout_prob": 1.0})"), "no error");
  EXPECT_THROW(BertConfig::load("/nonexistent/config.json"), UserError);
  // The weight quantizers' scale layout: written only when per-tensor, read back, checked.
  EXPECT_EQ(mini.to_json().find("weight_quantization"), nullptr);
  BertConfig per_tensor = mini;
  per_tensor.weight_scales = WeightScales::kPerTensor;
  EXPECT_EQ(per_tensor.to_json().find("weight_quantization")->as_string(), "per-tensor");
  EXPECT_EQ(BertConfig::from_json(per_tensor.to_json()).weight_scales, WeightScales::kPerTensor);
  EXPECT_EQ(error_of(R"({"weight_quantization": "per-row"})"),
            "model config field 'weight_quantization' 'per-row': expected per-channel (one scale per output channel) "
            "or per-tensor (one scale per weight)");
  EXPECT_EQ(error_of(R"({"weight_quantization": 1})"), "model config field 'weight_quantization' must be a string");

  // A regression: a one-output BertForSequenceClassification, as a cross-encoder reranker's config.json has it
  // (with or without problem_type); written back with problem_type "regression". Other problem types, and one
  // label for any other head, are refused.
  const std::string reranker =
      R"({"architectures": ["BertForSequenceClassification"], "id2label": {"0": "LABEL_0"}, "hidden_size": 32,
          "num_attention_heads": 2)";
  for (const std::string problem : {"", R"(, "problem_type": "regression")", R"(, "problem_type": null)"}) {
    const BertConfig r = BertConfig::from_json(Json::parse(reranker + problem + "}"));
    EXPECT_TRUE(r.regression()) << problem;
    EXPECT_EQ(r.to_json().find("problem_type")->as_string(), "regression");
    EXPECT_TRUE(BertConfig::from_json(r.to_json()).regression());
  }
  BertConfig three = BertConfig::from_json(Json::parse(reranker + "}"));
  three.labels = {"a", "b", "c"};
  EXPECT_FALSE(three.regression());
  EXPECT_EQ(three.to_json().find("problem_type"), nullptr);
  EXPECT_EQ(error_of(reranker + R"(, "problem_type": "multi_label_classification"})"),
            "model config: problem_type 'multi_label_classification' is not supported (single_label_classification, "
            "or regression with one output)");
  EXPECT_EQ(error_of(reranker + R"(, "problem_type": "single_label_classification"})"),
            "model config: a single-label classification needs at least 2 labels (1 is a regression)");
  EXPECT_EQ(error_of(R"({"architectures": ["BertForSequenceClassification"], "problem_type": "regression",
                         "id2label": {"0": "a", "1": "b"}})"),
            "model config: a regression with 2 outputs is not supported (one score per sequence)");
  EXPECT_EQ(error_of(R"({"architectures": ["BertForTokenClassification"], "id2label": {"0": "O"}})"),
            "invalid model config: BertForTokenClassification needs at least 2 labels");
}

}  // namespace
}  // namespace bert::model
